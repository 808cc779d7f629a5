-- park_many: take a slot of every one of several semaphores in arrival order, all together,
-- or park the waiter in the room of the first one that cannot take it yet; or, in claim
-- mode, take them with the slot a hand-off reserved on one of them.
--
-- KEYS[9i-8..9i]  slots, holders, limits, room, parked, deadlines, blocked, wake, claims of
--                 the i-th semaphore (see room.lua); on Redis Cluster all in one hash slot
-- ARGV[1..12]  lease_ms, token, metadata, waiter, arrival_ms ("" for now), payload,
--              claim_ms, room_ttl_ms, max_queued (0: no limit), mode ("park" or "claim"),
--              deadline_ms (0: none), delivery, as for park.lua (no hand-off grace: a
--              reservation here is kept for its waiter until its claim lease ends)
-- ARGV[11+2i], ARGV[12+2i]  limit and weight of the i-th semaphore
--
-- Returns {1, expires_at_ms, now_ms, 0, hand-offs...}    the waiter holds a slot of each
--         {0, position, now_ms, i, hand-offs...}         parked in the i-th one's room
--         {-1, queued, now_ms, i}                         the i-th one's room is full
--         {-2, again, now_ms, 0}                          claim mode: nothing reserved or
--                                                         parked for the waiter (see park.lua)
--
-- A semaphore takes the waiter now if it has room for its weight and no other waiter is
-- parked ahead of it there, or if it holds a reservation for it. When every one does, the
-- waiter takes them all. Otherwise it waits in the room of the first one that does not, and
-- only there: a reservation it held elsewhere is handed on to that room's next waiter, so it
-- never holds one semaphore's slot while it waits for another's.
if redis.replicate_commands then pcall(redis.replicate_commands) end
local now = room_now_ms()
local lease_ms, token, metadata, waiter = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
local payload, claim_ms, room_ttl_ms = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local max_queued, mode, deadline_ms = tonumber(ARGV[9]), ARGV[10], tonumber(ARGV[11])
local delivery = ARGV[12]
local count = #KEYS / 9

local function k(i, n) return KEYS[9 * (i - 1) + n] end
local given, limit, weight = {}, {}, {}
for i = 1, count do
  given[i] = tonumber(ARGV[11 + 2 * i])
  weight[i] = tonumber(ARGV[12 + 2 * i])
  limit[i] = live_limit(k(i, 3), given[i])
  room_prune(k(i, 1), k(i, 2), k(i, 4), k(i, 5), now)
  if redis.call('HEXISTS', k(i, 5), '!limit') == 1 then
    redis.call('HSET', k(i, 5), '!limit', given[i])  -- as park.lua: the latest caller's
  end
end

local mine = redis.call('ZSCORE', k(1, 1), token)
if mine then return {1, tonumber(mine), now, 0} end

-- Where the waiter is parked or reserved now, and since when it has asked.
local arrival = tonumber(ARGV[5])
local known = false
local reserved = {}
for i = 1, count do
  reserved[i] = redis.call('ZSCORE', k(i, 1), '~' .. waiter) ~= false
  local at = arrival_of(k(i, 5), waiter)
  if at then
    known = true
    arrival = at
    if payload == '' then payload = payload_of(redis.call('HGET', k(i, 5), waiter)) end
  end
  if reserved[i] then known = true end
end
arrival = arrival or now
if mode == 'claim' and not known then
  local again = delivery ~= '' and redis.call('HGET', k(1, 9), waiter) == delivery
  return {-2, again and 1 or 0, now, 0}
end

local function admits(i)
  if reserved[i] then return true end
  local slots, room = k(i, 1), k(i, 4)
  if redis.call('ZCARD', slots) + weight[i] > limit[i] then return false end
  local head = redis.call('ZRANGE', room, 0, 0)
  return #head == 0 or head[1] == waiter
end

local blocking = nil
for i = 1, count do
  if not admits(i) then blocking = i break end
end

local out = {}
local kept_deadline = 0  -- a give-up time it had where it waited: it keeps it when it moves
local function leave(i)
  -- Out of the i-th one's room, and its reservation there (if any) back to the room.
  local deadline = redis.call('ZSCORE', k(i, 6), waiter)
  if deadline then kept_deadline = math.max(kept_deadline, tonumber(deadline)) end
  redis.call('ZREM', k(i, 4), waiter)
  redis.call('HDEL', k(i, 5), waiter)
  redis.call('ZREM', k(i, 6), waiter)
  if reserved[i] then
    units_remove(k(i, 1), '~' .. waiter, nil)
    redis.call('HDEL', k(i, 2), '~' .. waiter)
    reserved[i] = false
  end
end

if not blocking then
  local expires_at_ms = now + lease_ms
  for i = 1, count do
    if reserved[i] and delivery ~= '' then
      redis.call('HSET', k(i, 9), waiter, delivery)
      redis.call('PEXPIRE', k(i, 9), room_ttl_ms)
    end
    leave(i)
    units_add(k(i, 1), token, weight[i], expires_at_ms)
    redis.call('HSET', k(i, 2), token, now .. '|' .. metadata)
    if redis.call('PTTL', k(i, 1)) < lease_ms then
      redis.call('PEXPIRE', k(i, 1), 2 * lease_ms)
      redis.call('PEXPIRE', k(i, 2), 2 * lease_ms)
    end
  end
  return {1, expires_at_ms, now, 0}
end

local b = blocking
local room, parked = k(b, 4), k(b, 5)
if not arrival_of(parked, waiter) and max_queued > 0
    and redis.call('ZCARD', room) >= max_queued then
  return {-1, redis.call('ZCARD', room), now, b}
end
-- Wait in the blocking one's room only; whatever it held elsewhere goes to the next waiter.
for i = 1, count do
  if i ~= b then
    leave(i)
    local room_of = room_limit(k(i, 3), k(i, 5))
    if room_of then
      room_hand_off(k(i, 1), k(i, 2), k(i, 4), k(i, 5), room_of, claim_ms, now, out)
    end
  end
end
local tag = weight[b] > 1 and ('#' .. weight[b]) or ''
redis.call('HSET', parked, waiter, arrival .. tag .. '|' .. payload, '!limit', given[b])
redis.call('ZADD', room, arrival, waiter)
local give_up_at = deadline_ms > 0 and deadline_ms or kept_deadline
if give_up_at > 0 then redis.call('ZADD', k(b, 6), give_up_at, waiter) end
room_hand_off(k(b, 1), k(b, 2), room, parked, limit[b], claim_ms, now, out)
local reply = {0, redis.call('ZRANK', room, waiter) or 0, now, b}
for i = 1, #out, 2 do
  -- Reserved for this waiter by the hand-off just now: it comes back for it as a claim.
  reply[#reply + 1] = out[i]
  reply[#reply + 1] = out[i + 1]
end
if redis.call('PTTL', room) < room_ttl_ms then
  redis.call('PEXPIRE', room, room_ttl_ms)
  redis.call('PEXPIRE', parked, room_ttl_ms)
end
local deadlines_ttl = redis.call('PTTL', k(b, 6))
if deadlines_ttl ~= -2 and deadlines_ttl < room_ttl_ms then
  redis.call('PEXPIRE', k(b, 6), room_ttl_ms)
end
return reply
