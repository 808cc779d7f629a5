-- cancel: take a waiter out of the room (its task was revoked or expired, or it gave up),
-- and hand its reservation, if it had one, to the next waiter.
--
-- KEYS[1..8]  slots, holders, limits, room, parked, deadlines, blocked, wake (see room.lua)
-- ARGV[1]  waiter    the waiter's id
-- ARGV[2]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1)
--
-- Returns {found, hand-offs...}: found is 1 when the waiter was parked or reserved.
local slots, holders, limits, room, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local deadlines, blocked, wake = KEYS[6], KEYS[7], KEYS[8]
local waiter, claim_ms = ARGV[1], tonumber(ARGV[2])

if redis.replicate_commands then pcall(redis.replicate_commands) end
local now = room_now_ms()
local reserved = redis.call('ZSCORE', slots, '~' .. waiter)
if reserved then units_remove(slots, '~' .. waiter, nil) end
local found = redis.call('ZREM', room, waiter) + redis.call('HDEL', parked, waiter)
  + (reserved and 1 or 0)
redis.call('ZREM', deadlines, waiter)
redis.call('HDEL', holders, '~' .. waiter)
local reply = {found > 0 and 1 or 0}
local limit = room_limit(limits, parked)
if limit then
  room_prune(slots, holders, room, parked, now)
  local out = {}
  room_hand_off(slots, holders, room, parked, limit, claim_ms, now, out)
  for _, value in ipairs(out) do reply[#reply + 1] = value end
  if #out == 0 and redis.call('ZCARD', slots) < limit then room_wake(blocked, wake, now) end
end
return reply
