-- rates: a key's start rates (GCRA, the generic cell rate algorithm, on the server's clock),
-- for the scripts that take slots under them. Not a script of its own.
--
-- A rate is {name, interval_ms, burst}: one unit every interval_ms (a float: "500/m" is 120),
-- and up to `burst` units at once after an idle spell. Its state is one number, its TAT
-- (theoretical arrival time, epoch ms), kept in the key's limits hash as "tat:<name>"; an
-- operator's live rate, "rate:<name>" -> "<interval_ms> <burst>", wins over the callers'.
-- A run of u units may start at the first instant s >= now at which every rate allows it,
-- s = max(now, TAT - (burst - u) * interval) over the rates, and then moves each TAT to
-- max(TAT, s) + u * interval. So over any span T no more than burst + T / interval units
-- start, and the next start's instant is known in advance: a waiting room reserves a slot
-- for that instant and its run is published to start then (room.lua), with no retry loop.
--
-- GCRA rather than a token bucket: one number per rate and no refill step, and the same
-- sums answer "may it start now" and "when may it start".

-- `count` rates given as a flat list from `first`, `stride` items each (name, interval_ms,
-- burst, ...), each with its live override and TAT read in one HMGET:
-- {{name, interval, burst, tat}, ...}. A TAT is kept with the interval it was reckoned
-- under ("<tat> <interval_ms>"): under another interval now (an operator set or cleared a
-- live rate, or a deploy changed the code's), what it is ahead of now is scaled to it (and
-- written back so), so the runs already counted weigh as many units under the new rate,
-- and a slow rate just cleared no longer spaces the next starts (a TAT with no interval is
-- taken as it is).
local function rates_read(limits, list, first, count, stride, now)
  local fields = {}
  for i = 0, count - 1 do
    local name = list[first + stride * i]
    fields[#fields + 1] = 'rate:' .. name
    fields[#fields + 1] = 'tat:' .. name
  end
  local got = redis.call('HMGET', limits, unpack(fields))
  local rates = {}
  for i = 0, count - 1 do
    local at = first + stride * i
    local interval, burst = tonumber(list[at + 1]), tonumber(list[at + 2])
    local live = got[2 * i + 1]
    if live then
      local li, lb = string.match(live, '^(%S+) (%S+)$')
      interval, burst = tonumber(li) or interval, tonumber(lb) or burst
    end
    local tat, under = string.match(got[2 * i + 2] or '', '^(%S+) ?(%S*)$')
    tat, under = tonumber(tat) or 0, tonumber(under)
    if under and under ~= interval and tat > now then
      tat = now + (tat - now) * interval / under
      -- Kept as scaled: a call the rate refuses takes nothing, and would otherwise ask
      -- again against the old TAT scaled anew from its later now, an instant that recedes
      -- with each ask until the old TAT itself has passed (a plain acquire, a shed run).
      redis.call('HSET', limits, 'tat:' .. list[at], string.format('%.3f %s', tat, interval))
    end
    rates[#rates + 1] = {list[at], interval, burst, tat}
  end
  return rates
end

-- The rates a room hands slots out by ("!rates" in its parked hash, which park.lua writes:
-- "<name> <interval_ms> <burst> ..."), or nil when it has none.
local function room_rates(slots, parked, now)
  local spec = redis.call('HGET', parked, '!rates')
  if not spec then return nil end
  local list = {}
  for item in string.gmatch(spec, '%S+') do list[#list + 1] = item end
  return rates_read(slots .. ':limits', list, 1, #list / 3, 3, now)
end

-- The units a run takes of rate `name`: units[name], else 1; never above the burst (a live
-- rate may lower the burst below what a run was refused at; it then waits for a full bucket).
local function rate_units(units, name, burst)
  return math.min(units and units[name] or 1, burst)
end

-- When a run of `units` may start (epoch ms, >= now) under every rate.
local function rates_start(rates, units, now)
  local start = now
  for _, r in ipairs(rates) do
    local u = rate_units(units, r[1], r[3])
    start = math.max(start, r[4] - (r[3] - u) * r[2])
  end
  return math.ceil(start)
end

-- How late a run may start after the instant it was given before it takes its units again:
-- half its own spacing under the rate that spaces it most (the one that holds it back). A
-- run later than that would crowd the next run's instant (two starts closer than the rate
-- allows, by the bodies' clocks); one within it keeps every window at the rate and burst.
-- The lesser spacing of a rate that does not hold runs back would re-time runs for nothing:
-- each re-timed run leaves its instant unused.
local function rates_slack(rates, units)
  local slack = nil
  for _, r in ipairs(rates) do
    local spacing = rate_units(units, r[1], r[3]) * r[2] / 2
    slack = math.max(slack or spacing, spacing)
  end
  return slack or 0
end

local STATE_TTL_MS = 86400000  -- how long a back-off's and an adaptive limit's state lasts

-- A limits hash of TATs alone lives until its last TAT passes (a TAT in the past is the
-- same as none), and one with a provider's state (adapt.lua's "a:" and "cool:" fields) a
-- day; one that holds an operator's setting (live limit, pause, live rate) has no TTL.
-- set_limit.lua calls this after each change, rates_take when the hash has no TTL.
local function rates_keep(limits, now)
  local last = nil
  local fields = redis.call('HGETALL', limits)
  for i = 1, #fields, 2 do
    local kind = string.match(fields[i], '^(%a+):')
    if kind == 'tat' then
      last = math.max(last or now, tonumber(string.match(fields[i + 1], '^%S+')) or now)
    elseif kind == 'a' or kind == 'cool' then
      last = math.max(last or now, now + STATE_TTL_MS)
    else
      redis.call('PERSIST', limits)
      return
    end
  end
  if last then redis.call('PEXPIRE', limits, math.ceil(last - now) + 1000) end
end

-- Take the run's units at `start`: move each TAT on, and keep the limits hash only as long
-- as it matters (see rates_keep).
local function rates_take(limits, rates, units, start, now)
  local fields, last = {}, now
  for _, r in ipairs(rates) do
    local tat = math.max(r[4], start) + rate_units(units, r[1], r[3]) * r[2]
    r[4] = tat
    fields[#fields + 1] = 'tat:' .. r[1]
    fields[#fields + 1] = string.format('%.3f %s', tat, r[2])
    last = math.max(last, tat)
  end
  if #fields == 0 then return end
  redis.call('HSET', limits, unpack(fields))
  local ttl = math.ceil(last - now) + 1000
  local left = redis.call('PTTL', limits)
  if left == -1 then
    rates_keep(limits, now)
  elseif left < ttl then
    redis.call('PEXPIRE', limits, ttl)
  end
end

-- A waiter's units per rate, from its parked entry's "r<name>=<u>,..." tag (nil: 1 each).
local function rate_units_of(entry)
  local tag = string.match(string.match(entry, '^[^|]*'), 'r([%w_=,]+)')
  if not tag then return nil end
  local units = {}
  for name, u in string.gmatch(tag, '([%w_]+)=(%d+)') do units[name] = tonumber(u) end
  return units
end
