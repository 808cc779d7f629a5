-- adapt: what a provider's answers do to a key, for release.lua, which is told how the run
-- it releases went. Not a script of its own.
--
--! uses: clock rates limit
--
-- A back-off (the provider answered "too many requests") cools the key down fleet-wide: no
-- slot is given before "cool:until" (epoch ms; live_limit answers 0 until then). A run that
-- ends well on a key whose limit is adaptive moves its limit up. The limits hash keeps:
--   "cool:until"  when the cool-down ends; "cool:ms" the last one taken with no hint
--   "cool:count"  back-offs so far; "cool:last" the last one, JSON {by, at, hint_ms}
--   "a:limit"     the adaptive limit (a float), within "a:min" and "a:max"
--   "a:ceiling"   the limit at which the last cut came: the limit grows back to one below
--                 it, and to it only to probe, once "a:probe_at" (epoch ms) has come; a
--                 failed probe doubles the gap to the next, "a:probe_ms"
--   "a:cut_at"    when the last cut came (epoch ms): a run that started before it (or in the
--                 same millisecond: a 429 takes a round trip) answers a limit already cut,
--                 and cuts no more
-- So the limit finds the provider's capacity, holds just under it, and pays the cool-down a
-- probe costs (every worker idle for it) once per probe gap, not on every climb as a plain
-- additive-increase, multiplicative-decrease sawtooth would.
local PROBE_MS, PROBE_MAX_MS, FIRST_COOL_MS = 10000, 15000, 1000

-- "<initial> <min> <max>" of an adaptive limit.
local function adapt_spec(spec)
  local initial, low, high = string.match(spec, '^(%S+) (%S+) (%S+)$')
  return tonumber(initial), tonumber(low), tonumber(high)
end

-- Keep the state as long as it matters: a hash with an operator's setting has no TTL, one
-- of state alone lasts STATE_TTL_MS past its last change (see rates_keep).
local function adapt_keep(limits, now)
  local left = redis.call('PTTL', limits)
  if left == -1 then
    rates_keep(limits, now)
  elseif left < STATE_TTL_MS / 2 then
    redis.call('PEXPIRE', limits, STATE_TTL_MS)
  end
end

-- A run ended well, with `held` units in use before its release and `waiting` true when
-- runs wait for the key: a saturated key (every unit held, or runs waiting) grows its
-- adaptive limit by 1 / limit, about one per limit successes, up to "a:max", and to its
-- ceiling only to probe. A success at the ceiling (a probe that held) forgets the ceiling.
-- An operator's live limit or pause freezes the adaptive limit.
local function adapt_grow(limits, spec, held, waiting, now)
  local s = redis.call('HMGET', limits, 'a:limit', 'a:ceiling', 'a:probe_at', 'limit',
    'paused_at')
  if s[4] or s[5] then return end
  local initial, low, high = adapt_spec(spec)
  local current = tonumber(s[1]) or initial
  local limit, ceiling = math.floor(current), tonumber(s[2])
  if held < limit and not waiting then return end
  if ceiling and limit >= ceiling and held >= ceiling then
    redis.call('HDEL', limits, 'a:ceiling', 'a:probe_at', 'a:probe_ms')
    ceiling = nil
  end
  local grown = math.min(high, current + 1 / math.max(1, limit))
  if ceiling then
    local cap = now >= (tonumber(s[3]) or 0) and ceiling or ceiling - 1
    grown = math.max(current, math.min(grown, cap))
  end
  redis.call('HSET', limits, 'a:limit', grown, 'a:min', low, 'a:max', high)
  adapt_keep(limits, now)
end

-- A back-off by `by` of a run that took its slot at `started` (epoch ms): cool the key down
-- for `hint_ms` (< 0: none: 1 s, doubled while back-offs follow one another within the last
-- cool-down's length, up to `cap_ms`), and, on an adaptive key (`spec` not ""), cut the
-- limit once per cool-down: by half, or, after a failed probe, back to just under the
-- ceiling. Returns when the cool-down ends (epoch ms).
local function adapt_back_off(limits, spec, hint_ms, cap_ms, started, by, now)
  local s = redis.call('HMGET', limits, 'cool:until', 'cool:ms', 'a:limit', 'a:ceiling',
    'a:cut_at', 'a:probe_ms', 'limit', 'paused_at')
  local cool, last = tonumber(s[1]) or 0, tonumber(s[2]) or 0
  local ms = hint_ms
  if ms < 0 then
    ms = FIRST_COOL_MS
    if last > 0 and now <= cool + last then ms = math.min(cap_ms, last * 2) end
    redis.call('HSET', limits, 'cool:ms', ms)
  end
  local ends = math.max(cool, now + ms)
  redis.call('HSET', limits, 'cool:until', ends,
    'cool:last', cjson.encode({by = by, at = now, hint_ms = hint_ms}))
  redis.call('HINCRBY', limits, 'cool:count', 1)
  if spec ~= '' and not s[7] and not s[8] and started > (tonumber(s[5]) or 0) then
    local initial, low, high = adapt_spec(spec)
    local current = tonumber(s[3]) or initial
    local limit, ceiling = math.floor(current), tonumber(s[4])
    local gap = PROBE_MS
    if ceiling and limit >= ceiling then  -- a probe failed: under the ceiling, and wait longer
      current, gap = ceiling - 1, math.min(PROBE_MAX_MS, 2 * (tonumber(s[6]) or PROBE_MS))
    else
      current, ceiling = current / 2, limit
    end
    redis.call('HSET', limits, 'a:limit', math.max(low, current), 'a:min', low, 'a:max', high,
      'a:ceiling', ceiling, 'a:cut_at', now, 'a:probe_at', ends + gap, 'a:probe_ms', gap)
  end
  adapt_keep(limits, now)
  return ends
end
