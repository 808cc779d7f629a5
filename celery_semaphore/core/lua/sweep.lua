-- sweep: the waiting room's safety net, run on a timer by every worker of the app.
--
-- KEYS[1..4]  slots, holders, room, parked (see room.lua)
-- ARGV[1]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1)
--
-- Returns the hand-offs ({waiter, payload} pairs) the caller publishes.
--
-- Frees lapsed holders and reservations, puts back into the room any parked waiter that is
-- neither queued nor reserved (a plain acquire pruned its reservation), and hands every free
-- slot to the oldest waiters. So a room drains even when every process that would have
-- released a slot died, and a hand-off whose message was lost is published again once its
-- reservation lapses.
local slots, holders, room, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local claim_ms = tonumber(ARGV[1])

if redis.replicate_commands then pcall(redis.replicate_commands) end
local now = room_now_ms()
local limit = tonumber(redis.call('HGET', parked, '!limit'))
if not limit then return {} end
room_prune(slots, holders, room, parked, now)
for _, waiter in ipairs(redis.call('HKEYS', parked)) do
  if waiter ~= '!limit' and not redis.call('ZSCORE', room, waiter)
      and not redis.call('ZSCORE', slots, '~' .. waiter) then
    redis.call('ZADD', room, arrival_of(parked, waiter) or now, waiter)
  end
end
local out = {}
room_hand_off(slots, holders, room, parked, limit, claim_ms, now, out)
if redis.call('ZCARD', room) == 0 and redis.call('HLEN', parked) <= 1 then
  redis.call('DEL', room, parked)
end
return out
