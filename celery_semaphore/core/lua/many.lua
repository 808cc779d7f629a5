-- many: the steps of a waiter that needs several keys, shared by the two scripts that are
-- given all of its keys (park_many.lua, its run; gather.lua, anyone a room's hand-off told
-- of it). Not a script of its own.
--
--! uses: room
--
-- Such a waiter is parked in the room of every key it needs at the same place (its arrival:
-- the same order in every room, ties by id), with the record "!m:<waiter>" of all its keys
-- (see room.lua). In each room it is, at any moment, one of:
--   active    in the room's order: the room serves it in turn, strictly (room.lua's hand-off
--             reserves its units when it is first and they fit, and serves nobody behind it
--             while they do not);
--   reserved  its units are reserved there ("~<waiter>", marked "waiting" until it is handed
--             off; see gather.lua);
--   passive   "!p:<waiter>": it gave back what the room reserved for it, and is out of the
--             room's order, keeping its place: the room serves those behind it meanwhile.
-- and "!h:<waiter>" is set in every room once it gave something back: from then on it keeps
-- what it is given when only capacity stands between it and its other keys.
--
-- Why it does not simply keep every reservation while it waits: a key whose turn came would
-- then hold units idle for a run stuck behind older runs (or a full key) elsewhere; with
-- [("openai", 20), ("tenant:{t}", 2)], the first waiting run of every busy tenant would hold
-- an openai unit idle, and those add up. Why it does not give everything back each time (as
-- it did before): then the keys never give it their units together while each has a backlog
-- of its own, and later runs pass it indefinitely. So:
--   1. each room serves its own order; a passive waiter that is first there (nobody active
--      is older) and fits takes its units back;
--   2. with a reservation of every key, it is served (the caller takes or hands off);
--   3. with only capacity in its way elsewhere (it is first in every room it has no
--      reservation of) and "!h:" set, it keeps its reservations, and becomes active in every
--      other room: each gives it the next units it frees, however many runs wait behind it;
--   4. else it gives back every reservation (each room serves its next waiters with them)
--      and is passive there, and "!h:" is set; it is active in every room where older runs
--      are ahead of it (so it always waits in some room's order), and stays passive in a
--      room where it is first but would not fit (stopping that room for it would only idle
--      it while it waits elsewhere).
-- A passive waiter is passed only while it waits its turn in another room, where it is
-- active, behind runs older than itself (or for one release of a full key): when that room
-- serves it, it is first in every room that passed it, so it holds (step 3). So runs that
-- came after it cannot pass it indefinitely, and no unit is kept idle for a waiter that has
-- older runs ahead of it somewhere. Two waiters cannot each hold what the other waits for:
-- one that holds is first, by its place, in every room it waits in, and places are the same
-- in every room. A waiter that becomes active ahead of a room's first waiter (it comes back
-- at its old place, or parks later with an earlier arrival) asks for that one to be
-- gathered again when it needs several keys: what it holds it may hold no longer.

-- Whether a waiter at `place` is first in `room`: it heads it, or nobody in it is older.
local function many_first(room, waiter, place)
  local head = redis.call('ZRANGE', room, 0, 0, 'WITHSCORES')
  return #head == 0 or head[1] == waiter or place < tonumber(head[2])
end

-- Put `waiter` into the order of `s` at `place`; a waiter of several keys it gets ahead of
-- is appended to out to be gathered again ({"!<waiter>", keys}, as room.lua's hand-off).
local function many_requeue(s, waiter, place, out)
  local head = redis.call('ZRANGE', s.room, 0, 0, 'WITHSCORES')
  if #head > 0 and head[1] ~= waiter and place < tonumber(head[2]) then
    local keys = redis.call('HGET', s.parked, '!m:' .. head[1])
    if keys then
      out[#out + 1] = '!' .. head[1]
      out[#out + 1] = keys
    end
  end
  redis.call('HDEL', s.parked, '!p:' .. waiter)
  room_requeue(s.room, s.parked, place, waiter)
end

-- Serve every room of `waiter` (each `s` of `sems`: slots, holders, room, parked, limit,
-- weight) and decide, as above, what it holds. Appends the hand-offs of others to out.
-- Returns true when it holds a reservation of every key.
local function many_settle(sems, waiter, place, claim_ms, now, out)
  local reserved = {}
  for i, s in ipairs(sems) do
    local handed = {}
    room_hand_off(s.slots, s.holders, s.room, s.parked, s.deadlines, s.limit, claim_ms, now,
                  handed)
    for j = 1, #handed, 2 do
      if handed[j] ~= '!' .. waiter then
        out[#out + 1] = handed[j]
        out[#out + 1] = handed[j + 1]
      end
    end
    reserved[i] = redis.call('ZSCORE', s.slots, '~' .. waiter) ~= false
    if not reserved[i] and redis.call('HEXISTS', s.parked, '!p:' .. waiter) == 1
        and many_first(s.room, waiter, place)
        and redis.call('ZCARD', s.slots) + s.weight <= s.limit then
      room_reserve(s.slots, s.deadlines, s.parked, waiter, s.weight, now + claim_ms)
      room_bring_on(s.slots, s.parked, now + claim_ms, out)
      local record = {reserved_for = waiter, limit = s.limit, waiting = true}
      if s.weight > 1 then record.weight = s.weight end
      redis.call('HSET', s.holders, '~' .. waiter, now .. '|' .. cjson.encode(record))
      redis.call('HDEL', s.parked, '!p:' .. waiter)
      -- As room.lua's hand-off: each key on its own (a hash made after the set has no TTL).
      keep_ttl(s.slots, claim_ms, claim_ms)
      keep_ttl(s.holders, claim_ms, claim_ms)
      reserved[i] = true
    end
  end
  local complete, capacity_only = true, true
  for i, s in ipairs(sems) do
    if not reserved[i] then
      complete = false
      if not many_first(s.room, waiter, place) then capacity_only = false end
    end
  end
  if complete then return true end
  if capacity_only and redis.call('HEXISTS', sems[1].parked, '!h:' .. waiter) == 1 then
    for i, s in ipairs(sems) do
      if not reserved[i] then many_requeue(s, waiter, place, out) end
    end
    return false
  end
  local gave = false
  for i, s in ipairs(sems) do
    if reserved[i] then
      gave = true
      units_remove(s.slots, '~' .. waiter, nil)
      redis.call('HDEL', s.holders, '~' .. waiter)
      redis.call('HSET', s.parked, '!p:' .. waiter, 1)
      room_hand_off(s.slots, s.holders, s.room, s.parked, s.deadlines, s.limit, claim_ms, now,
                    out)
    elseif not many_first(s.room, waiter, place) then
      many_requeue(s, waiter, place, out)
    end
  end
  if gave then
    for _, s in ipairs(sems) do redis.call('HSET', s.parked, '!h:' .. waiter, 1) end
  end
  return false
end

-- Take `waiter` out of every room of `sems` (its reservations too): it took its slots.
local function many_leave(sems, waiter)
  for _, s in ipairs(sems) do
    units_remove(s.slots, '~' .. waiter, nil)
    redis.call('HDEL', s.holders, '~' .. waiter)
    redis.call('ZREM', s.room, waiter)
    redis.call('HDEL', s.parked, waiter, '!m:' .. waiter, '!p:' .. waiter, '!h:' .. waiter)
    redis.call('ZREM', s.deadlines, waiter, '~' .. waiter)
  end
end
