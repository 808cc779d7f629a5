-- release: give one slot back, and hand it to the oldest parked waiter in the same step.
--
-- KEYS[1..8]  slots, holders, limits, room, parked, deadlines, blocked, wake (see room.lua)
-- ARGV[1]  token     the holder's token
-- ARGV[2]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1), or
--                    0 when the caller cannot publish hand-offs: the slot is left free, and
--                    the next sweep hands it out
-- ARGV[3]  weight    the holder's weight, or "" when the caller does not know it (an
--                    operator's force release): then every "<token>#i" member goes
--
-- Returns {owned, hand-offs...}: owned is 1 when the slot was still ours up to this moment
-- (present, expiry in the future), 0 when it had lapsed or been taken away (the bound did
-- not hold for the whole body); hand-offs are {waiter, payload} pairs the caller publishes.
-- The holder is removed either way, and a semaphore with no holder and no room is deleted.
-- The limit comes from the room (a live limit, else "!limit", written by park.lua): no room,
-- no hand-off.
-- A freed slot that no parked waiter took wakes one caller blocked on the wake list.
local slots, holders, limits, room, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local blocked, wake = KEYS[7], KEYS[8]
local token, claim_ms, weight = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])

if redis.replicate_commands then pcall(redis.replicate_commands) end
local now = room_now_ms()

local score = redis.call('ZSCORE', slots, token)
local reply = {0}
if score then
  if tonumber(score) > now then reply[1] = 1 end
  units_remove(slots, token, weight)
  redis.call('HDEL', holders, token)
end
local limit = room_limit(limits, parked)
if limit and claim_ms > 0 then
  room_prune(slots, holders, room, parked, now)
  local out = {}
  room_hand_off(slots, holders, room, parked, limit, claim_ms, now, out)
  for _, value in ipairs(out) do reply[#reply + 1] = value end
elseif not limit and redis.call('ZCARD', slots) == 0 then
  redis.call('DEL', slots, holders)
end
if score and #reply == 1 then room_wake(blocked, wake, now) end
return reply
