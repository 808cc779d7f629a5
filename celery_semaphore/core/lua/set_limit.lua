-- set_limit: set (or clear) a key's live limit, which wins over the limit its callers give,
-- and hand the capacity a raise frees to the oldest parked waiters in the same step.
--
-- KEYS[1..8]  slots, holders, limits, room, parked, deadlines, blocked, wake (see room.lua)
-- ARGV[1]  limit     the new live limit (integer >= 1), or "" to clear it
-- ARGV[2]  by        who sets it (text shown by the views)
-- ARGV[3]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1), or
--                    0 when the caller cannot publish hand-offs (the next sweep hands out)
--
-- Returns {previous, now_ms, hand-offs...}: previous is the live limit before (0: none);
-- hand-offs are {waiter, payload} pairs the caller publishes.
--
-- Lowering a limit evicts nobody: holders keep their slots, and new ones are refused until
-- the key is under the new limit. The limits hash has no TTL: an operator's setting stays
-- until it is cleared.
local slots, holders, limits, room, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local blocked, wake = KEYS[7], KEYS[8]
local claim_ms = tonumber(ARGV[3])

if redis.replicate_commands then pcall(redis.replicate_commands) end
local now = room_now_ms()
local previous = tonumber(redis.call('HGET', limits, 'limit')) or 0
if ARGV[1] == '' then
  redis.call('DEL', limits)
else
  redis.call('HSET', limits, 'limit', ARGV[1], 'set_at', now, 'by', ARGV[2])
end

local reply = {previous, now}
local limit = room_limit(limits, parked)
if limit and claim_ms > 0 then
  room_prune(slots, holders, room, parked, now)
  local out = {}
  room_hand_off(slots, holders, room, parked, limit, claim_ms, now, out)
  for _, value in ipairs(out) do reply[#reply + 1] = value end
end
-- Wake blocked callers for what is still free (each woken caller asks again, and blocks
-- again if it finds the key full, so a wake too many costs one call).
limit = limit or tonumber(ARGV[1])
local free = limit and (limit - redis.call('ZCARD', slots)) or redis.call('ZCARD', blocked)
for _ = 1, math.min(free, redis.call('ZCARD', blocked)) do room_wake(blocked, wake, now) end
return reply
