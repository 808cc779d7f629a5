-- room: the waiting room's shared steps, which scripts.py puts into the scripts that use
-- them (park, release, sweep, cancel, set_limit): in place of a "--[[room.lua]]" line, below
-- a script's fast path, or else at its top. Not a script of its own.
--
-- Keys of one semaphore (one hash tag, so one cluster slot):
--   slots    sorted set: holder token -> lease expiry (ms); a reservation is "~<waiter>". A
--            holder of weight w > 1 has w members: its token, then "<token>#2".."<token>#w",
--            all with the same expiry, so the set's size is the units in use
--   holders  hash: token -> "<acquired_at_ms>|<metadata JSON>"
--   limits   hash: "limit" -> a live limit an operator set, "set_at" -> when (ms), "by" -> who;
--            it overrides the callers' limit while it exists (set_limit.lua)
--   room     sorted set: waiter id -> arrival (ms); the oldest is served first
--   parked   hash: waiter id -> "<arrival_ms>[#<weight>][@<turn>]|<payload>" (a weight above
--            1; the turn of a waiter parked with a fair-turn group, which is its place in
--            the room instead of its arrival), plus "!limit" -> the limit the last parking
--            caller gave (a live limit, when set, overrides it), and "!g:<group>" -> the
--            last turn given to a fair-turn group
--   deadlines  sorted set: waiter id -> when it gives up waiting (ms); only waiters with a
--            time budget are in it (sweep.lua sends them their give-up)
--   blocked  sorted set: token of a caller blocked in BLPOP on "wake" -> when it stops (ms)
--   wake     list: one element pushed per freed slot that no parked waiter took, to wake one
--            blocked caller (Semaphore.acquire with wait=...)
--   claims   hash: waiter id -> the id of the message whose run claimed its hand-off (park.lua
--            only), so a redelivery of that message is told from a duplicate copy
--
-- A reservation holds a slot for one waiter, so the limit counts it like any holder; the
-- waiter's run claims it when it starts (park.lua), or it lapses after the claim lease and
-- the waiter goes back into the room at its old arrival time: nothing is lost, and the order
-- is kept. (A plain acquire, which does not know the room, may prune a lapsed reservation
-- without requeueing it; sweep.lua finds such waiters.)

local function room_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The limit that applies: a live limit if one is set, else `given` (a number or nil).
local function live_limit(limits, given)
  return tonumber(redis.call('HGET', limits, 'limit')) or given
end

-- The limit a release or sweep hands slots out by, or nil when the key has no room.
local function room_limit(limits, parked)
  local given = tonumber(redis.call('HGET', parked, '!limit'))
  if not given then return nil end
  return live_limit(limits, given)
end

local function arrival_of(parked, waiter)
  local entry = redis.call('HGET', parked, waiter)
  if not entry then return nil end
  return tonumber(string.match(entry, '^(%d+)'))
end

-- The payload of a parked entry "<arrival_ms>[#<weight>][@<turn>]|<payload>".
local function payload_of(entry)
  return string.sub(entry, string.len(string.match(entry, '^[%d#@]+|')) + 1)
end

-- Where a parked waiter stands in the room: its fair turn, else its arrival (nil: unknown).
local function place_of(parked, waiter)
  local entry = redis.call('HGET', parked, waiter)
  if not entry then return nil end
  local head = string.match(entry, '^[%d#@]+')
  return tonumber(string.match(head, '@(%d+)')) or tonumber(string.match(head, '^(%d+)'))
end

-- The weight of a parked entry: how many units its run takes.
local function weight_of(entry)
  return tonumber(string.match(string.match(entry, '^[%d#@]+'), '#(%d+)')) or 1
end

-- Add (or re-score) the `weight` members of holder `member`, expiring at `score`.
local function units_add(slots, member, weight, score)
  redis.call('ZADD', slots, score, member)
  for i = 2, weight do redis.call('ZADD', slots, score, member .. '#' .. i) end
end

-- Remove the members of holder `member`: `weight` of them, or, when the weight is unknown
-- (nil), as many as there are.
local function units_remove(slots, member, weight)
  redis.call('ZREM', slots, member)
  local i = 2
  while (weight == nil or i <= weight)
      and redis.call('ZREM', slots, member .. '#' .. i) == 1 do
    i = i + 1
  end
end

-- Put a waiter back into the room. If the room had emptied (and so was deleted), this
-- re-creates it: give it the parked hash's TTL, as park.lua would have, so no key of the
-- room is ever left without one.
local function room_requeue(room, parked, arrival, waiter)
  redis.call('ZADD', room, arrival, waiter)
  if redis.call('PTTL', room) == -1 then
    local ttl = redis.call('PTTL', parked)
    if ttl > 0 then redis.call('PEXPIRE', room, ttl) end
  end
end

-- Drop lapsed holders; a lapsed reservation sends its waiter back into the room.
local function room_prune(slots, holders, room, parked, now)
  local expired = redis.call('ZRANGEBYSCORE', slots, '-inf', now)
  if #expired == 0 then return end
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
  redis.call('HDEL', holders, unpack(expired))
  for _, member in ipairs(expired) do
    if string.sub(member, 1, 1) == '~' and not string.find(member, '#', 1, true) then
      local waiter = string.sub(member, 2)
      local place = place_of(parked, waiter)
      if place then room_requeue(room, parked, place, waiter) end
    end
  end
end

-- Reserve free slots for the oldest waiters, in strict order: a head whose weight does not
-- fit waits, and nobody behind it is served first. Append {waiter, payload} pairs to out.
local function room_hand_off(slots, holders, room, parked, limit, claim_ms, now, out)
  if claim_ms <= 0 then return end
  while redis.call('ZCARD', slots) < limit do
    local head = redis.call('ZRANGE', room, 0, 0)
    if #head == 0 then break end
    local waiter = head[1]
    local entry = redis.call('HGET', parked, waiter)
    if entry then
      local weight = weight_of(entry)
      if redis.call('ZCARD', slots) + weight > limit then break end
      units_add(slots, '~' .. waiter, weight, now + claim_ms)
      local record = {reserved_for = waiter, limit = limit}
      if weight > 1 then record.weight = weight end
      redis.call('HSET', holders, '~' .. waiter, now .. "|" .. cjson.encode(record))
      out[#out + 1] = waiter
      out[#out + 1] = payload_of(entry)
    end
    redis.call('ZREM', room, waiter)
  end
  if redis.call('PTTL', slots) < claim_ms then
    redis.call('PEXPIRE', slots, claim_ms)
    redis.call('PEXPIRE', holders, claim_ms)
  end
end

-- Wake one caller blocked on the wake list, if any (a slot was freed and the room did not
-- take it). The list is trimmed to the number of blocked callers, so it stays small.
local function room_wake(blocked, wake, now)
  if redis.call('EXISTS', blocked) == 0 then return end
  redis.call('ZREMRANGEBYSCORE', blocked, '-inf', now)
  local count = redis.call('ZCARD', blocked)
  if count == 0 then return end
  redis.call('LPUSH', wake, now)
  redis.call('LTRIM', wake, 0, count - 1)
  local last = redis.call('ZRANGE', blocked, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', wake, math.max(1, tonumber(last[2]) - now))
end
