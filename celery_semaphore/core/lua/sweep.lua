-- sweep: the waiting room's safety net, run on a timer by every worker of the app.
--
-- KEYS[1..8]  slots, holders, limits, room, parked, deadlines, blocked, wake (see room.lua)
-- ARGV[1]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1)
--
-- Returns {alive, hand-offs, give-ups}: alive is 0 once the room is gone (nothing parked);
-- hand-offs and give-ups are flat {waiter, payload, ...} lists the caller publishes.
--
-- Frees lapsed holders and reservations, puts back into the room any parked waiter that is
-- neither queued nor reserved (a plain acquire pruned its reservation), and hands every free
-- slot to the oldest waiters. So a room drains even when every process that would have
-- released a slot died, and a hand-off whose message was lost is published again once its
-- reservation lapses.
--
-- A waiter still in the room past its deadline is given up: its payload is returned for the
-- caller to publish as a give-up (the run then cancels itself and fails). It stays parked
-- until that run cancels it, and its deadline moves claim_ms ahead, so a give-up whose
-- message was lost is sent again, and a hand-off that comes first still starts it.
local slots, holders, limits, room, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local deadlines, blocked, wake = KEYS[6], KEYS[7], KEYS[8]
local claim_ms = tonumber(ARGV[1])

if redis.replicate_commands then pcall(redis.replicate_commands) end
local now = room_now_ms()
local limit = room_limit(limits, parked)
if not limit then
  redis.call('DEL', deadlines)
  return {0, {}, {}}
end
room_prune(slots, holders, room, parked, now)
for _, waiter in ipairs(redis.call('HKEYS', parked)) do
  if string.sub(waiter, 1, 1) ~= '!' and not redis.call('ZSCORE', room, waiter)
      and not redis.call('ZSCORE', slots, '~' .. waiter) then
    room_requeue(room, parked, place_of(parked, waiter) or now, waiter)
  end
end
local out = {}
room_hand_off(slots, holders, room, parked, limit, claim_ms, now, out)
if redis.call('ZCARD', slots) < limit then room_wake(blocked, wake, now) end
local give_ups = {}
for _, waiter in ipairs(redis.call('ZRANGEBYSCORE', deadlines, '-inf', now)) do
  local entry = redis.call('HGET', parked, waiter)
  if not entry then
    redis.call('ZREM', deadlines, waiter)
  elseif redis.call('ZSCORE', room, waiter) then
    redis.call('ZADD', deadlines, now + claim_ms, waiter)
    give_ups[#give_ups + 1] = waiter
    give_ups[#give_ups + 1] = payload_of(entry)
  end
end
local waiting = 0
for _, field in ipairs(redis.call('HKEYS', parked)) do
  if string.sub(field, 1, 1) ~= '!' then waiting = waiting + 1 end
end
if redis.call('ZCARD', room) == 0 and waiting == 0 then
  redis.call('DEL', room, parked, deadlines)
  return {0, out, give_ups}
end
return {1, out, give_ups}
