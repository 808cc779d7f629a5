-- recover: after a call whose answer was lost (a timeout, a dropped connection, a frozen
-- server), put right what its caller could not do: give back the slot the call may have
-- taken, and hand back the reservations it may have made, for the caller to publish again.
--
-- KEYS[1..8]  slots, holders, limits, room, parked, deadlines, blocked, wake (see room.lua)
-- ARGV[1]  token     the lost call's token ("" for none: a sweep, a cancel, a live limit):
--                    a slot it still holds goes back, whatever the call was (a park or
--                    claim whose answer never came, a release that may not have run)
-- ARGV[2]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1)
-- ARGV[3]  since_ms  how long ago the lost call was sent, by the caller's clock (>= 0)
--
-- Returns {released, hand-offs...}: released is 1 when the token held a slot until now;
-- hand-offs are {waiter, payload} pairs the caller publishes: every reservation made since
-- the lost call was sent (with a second to spare), and any slot this call hands off.
--
-- A reservation made by the lost call was never published, and would otherwise stand idle
-- until its claim lease ends. Others made in the same window were published by their own
-- callers: publishing them again is a duplicate copy, which its run tells apart (claims) and
-- ends quietly; a missing one costs a whole claim lease. A reservation of a waiter that
-- needs several keys and still waits for some is answered as room.lua's hand-off answers it
-- ({"!<waiter>", keys}: the caller gathers it); one that gather.lua handed off, as any other.
--! uses: room
local slots, holders, limits, room, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local deadlines, blocked, wake = KEYS[6], KEYS[7], KEYS[8]
local token, claim_ms, since_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])

local now = now_ms()
local released = 0
if token ~= '' and redis.call('ZSCORE', slots, token) then
  units_remove(slots, token, nil)
  redis.call('HDEL', holders, token)
  released = 1
end
local reply = {released}
local limit = room_limit(limits, parked)
if limit then
  room_keep(room, parked, deadlines)
  -- A reservation lives claim_ms from when it was made: one made since the call was sent
  -- expires at least that long after it.
  local made_since = now - since_ms - 1000 + claim_ms
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', slots, made_since, '+inf')) do
    if string.sub(member, 1, 1) == '~' and not string.find(member, '#', 1, true) then
      local waiter = string.sub(member, 2)
      local entry = redis.call('HGET', parked, waiter)
      local needs = redis.call('HGET', parked, '!m:' .. waiter)
      local held = redis.call('HGET', holders, member) or ''
      if entry and needs and string.find(held, '"waiting"', 1, true) then
        reply[#reply + 1] = '!' .. waiter
        reply[#reply + 1] = needs
      elseif entry then
        reply[#reply + 1] = waiter
        reply[#reply + 1] = payload_of(entry)
      end
    end
  end
  room_prune(slots, holders, room, parked, now)
  room_hand_off(slots, holders, room, parked, deadlines, limit, claim_ms, now, reply)
end
if released == 1 and #reply == 1 then room_wake(blocked, wake, now) end
return reply
