-- set_limit: set (or clear) a key's live limit, which wins over the limit its callers give,
-- and pause or resume the key; hand the capacity a change frees to the oldest parked
-- waiters in the same step.
--
-- KEYS[1..8]  slots, holders, limits, room, parked, deadlines, blocked, wake (see room.lua)
-- ARGV[1]  limit     the new live limit (integer >= 1), "" to clear it, "=" to leave it
-- ARGV[2]  by        who makes the change (text shown by the views)
-- ARGV[3]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1), or
--                    0 when the caller cannot publish hand-offs (the next sweep hands out:
--                    the reply asks for it now, as release.lua's does)
-- ARGV[4]  pause     "1" to pause the key, "0" to resume it, absent or "" to leave it
--
-- Returns {previous, now_ms, was_paused, hand-offs...}: previous is the live limit before
-- (0: none), was_paused 1 when the key was paused before; hand-offs are {waiter, payload}
-- pairs the caller publishes.
--
-- Lowering a limit, or pausing, evicts nobody: holders keep their slots (and renew them),
-- and new ones are refused until the key is under the limit that applies, which is 0 while
-- it is paused. The limits hash has no TTL while it holds an operator's setting, which stays
-- until it is cleared (start rates' state alone expires: rates.lua); a change of the limit
-- leaves a pause alone, and the other way round.
--! uses: room
local slots, holders, limits, room, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local blocked, wake = KEYS[7], KEYS[8]
local claim_ms, pause = tonumber(ARGV[3]), ARGV[4] or ''

local now = now_ms()
local before = redis.call('HMGET', limits, 'limit', 'paused_at')
if ARGV[1] == '' then
  redis.call('HDEL', limits, 'limit', 'set_at', 'by')
elseif ARGV[1] ~= '=' then
  redis.call('HSET', limits, 'limit', ARGV[1], 'set_at', now, 'by', ARGV[2])
end
if pause == '1' then
  if not before[2] then redis.call('HSET', limits, 'paused_at', now, 'paused_by', ARGV[2]) end
elseif pause == '0' then
  redis.call('HDEL', limits, 'paused_at', 'paused_by')
end
rates_keep(limits, now)  -- no TTL while an operator's setting stands

local reply = {tonumber(before[1]) or 0, now, before[2] and 1 or 0}
local limit = room_limit(limits, parked)
if limit then room_keep(room, parked, KEYS[6]) end
if limit and claim_ms > 0 then
  room_prune(slots, holders, room, parked, now)
  local out = {}
  room_hand_off(slots, holders, room, parked, KEYS[6], limit, claim_ms, now, out)
  for _, value in ipairs(out) do reply[#reply + 1] = value end
elseif limit and redis.call('ZCARD', room) > 0 then
  room_bring_on(slots, parked, 0, reply)
end
-- Wake blocked callers for what is still free (each woken caller asks again, and blocks
-- again if it finds the key full, so a wake too many costs one call).
limit = limit or live_limit(limits, nil)
local free = limit and (limit - redis.call('ZCARD', slots)) or redis.call('ZCARD', blocked)
for _ = 1, math.min(free, redis.call('ZCARD', blocked)) do room_wake(blocked, wake, now) end
return reply
