-- cancel: take a waiter out of the room (its task was revoked or expired, or it gave up),
-- and hand its reservation, if it had one, to the next waiter; a waiter that needs several
-- keys leaves all of their rooms in one call.
--
-- KEYS[8i-7..8i]  slots, holders, limits, room, parked, deadlines, blocked, wake (see
--                 room.lua) of one key, or of every key the waiter needs (one hash slot on
--                 Redis Cluster)
-- ARGV[1]  waiter    the waiter's id
-- ARGV[2]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1)
--
-- Returns {found, hand-offs...}: found is 1 when the waiter was parked or reserved.
--         {-1, keys}: it needs several keys (keys: its "!m:" record, see room.lua) and one
--         key's were given: nothing was done; call again with those keys' (each its 8).
--
-- So a waiter of several keys never stays parked in some of its rooms, or holds units
-- there, once it was cancelled in one: a cancel is for all of them, or none.
--! uses: room
local waiter, claim_ms = ARGV[1], tonumber(ARGV[2])
local count = #KEYS / 8
local function k(i, n) return KEYS[8 * (i - 1) + n] end

if count == 1 then
  local needs = redis.call('HGET', KEYS[5], '!m:' .. waiter)
  if needs and #cjson.decode(needs) > 1 then return {-1, needs} end
end
local now = now_ms()
local found = 0
for i = 1, count do
  local slots, holders, room, parked = k(i, 1), k(i, 2), k(i, 4), k(i, 5)
  local reserved = redis.call('ZSCORE', slots, '~' .. waiter)
  if reserved then units_remove(slots, '~' .. waiter, nil) end
  found = found + redis.call('ZREM', room, waiter) + redis.call('HDEL', parked, waiter)
    + (reserved and 1 or 0)
  redis.call('HDEL', parked, '!m:' .. waiter, '!p:' .. waiter, '!h:' .. waiter)
  redis.call('ZREM', k(i, 6), waiter, '~' .. waiter)
  redis.call('HDEL', holders, '~' .. waiter)
end
local reply = {found > 0 and 1 or 0}
for i = 1, count do
  local slots, holders, room, parked = k(i, 1), k(i, 2), k(i, 4), k(i, 5)
  local limit = room_limit(k(i, 3), parked)
  if limit then
    room_keep(room, parked, k(i, 6))
    room_prune(slots, holders, room, parked, now)
    local out = {}
    room_hand_off(slots, holders, room, parked, k(i, 6), limit, claim_ms, now, out)
    for _, value in ipairs(out) do reply[#reply + 1] = value end
    if #out == 0 and redis.call('ZCARD', slots) < limit then
      room_wake(k(i, 7), k(i, 8), now)
    end
  end
end
return reply
