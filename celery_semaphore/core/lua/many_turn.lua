-- many_turn: a waiter of several keys takes them all in arrival order, or waits in the room
-- of every one of them at once: the steps of park_many.lua (a run that finds a key full)
-- and claim_many.lua (a handed-off run that starts), whose contracts give the arguments
-- and answers. Not a script of its own.
--
-- The waiter takes every semaphore now if each has room for its weight and no other waiter
-- ahead of it there, or holds a reservation for it. Otherwise it waits in the room of every
-- one, and many.lua's steps decide, with all of them in view, what it holds meanwhile: it
-- is handed off (gather.lua) once it holds all of them, and its run's claim takes them.
--
--! uses: many

-- `claim`: the run's claim (a waiter no room knows of is not parked anew).
local function many_turn(claim)
  local now = now_ms()
  local lease_ms, token, metadata, waiter = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
  local payload, how, sizes = ARGV[5], cjson.decode(ARGV[6]), cjson.decode(ARGV[7])
  local claim_ms, room_ttl_ms, max_queued = how.claim_ms, how.ttl_ms, how.max_queued
  local mode, deadline_ms = claim and 'claim' or 'park', how.deadline_ms
  local delivery = how.delivery
  local count = #KEYS / 9

  local function k(i, n) return KEYS[9 * (i - 1) + n] end
  local sems, given = {}, {}
  for i = 1, count do
    given[i] = sizes[2 * i - 1]
    sems[i] = {slots = k(i, 1), holders = k(i, 2), room = k(i, 4), parked = k(i, 5),
               deadlines = k(i, 6), limit = live_limit(k(i, 3), given[i]),
               weight = sizes[2 * i]}
    room_prune(k(i, 1), k(i, 2), k(i, 4), k(i, 5), now)
    if redis.call('HEXISTS', k(i, 5), '!limit') == 1 then
      redis.call('HSET', k(i, 5), '!limit', given[i])  -- as park.lua: the latest caller's
    end
  end

  local mine = redis.call('ZSCORE', k(1, 1), token)
  if mine then return {1, tonumber(mine), now, 0} end

  -- Where the waiter is parked or reserved now, since when it has asked, and when it gives up.
  local arrival = tonumber(how.arrival_ms)
  if arrival and arrival < 0 then arrival = now + arrival end  -- a wait (see park.lua)
  local known, reserved, passive = false, {}, {}
  local kept_deadline = 0
  for i = 1, count do
    reserved[i] = redis.call('ZSCORE', k(i, 1), '~' .. waiter) ~= false
    passive[i] = redis.call('HEXISTS', k(i, 5), '!p:' .. waiter) == 1
    local at = arrival_of(k(i, 5), waiter)
    if at then
      known = true
      arrival = at
      if payload == '' then payload = payload_of(redis.call('HGET', k(i, 5), waiter)) end
    end
    if reserved[i] then known = true end
    local deadline = redis.call('ZSCORE', k(i, 6), waiter)
    if deadline then kept_deadline = math.max(kept_deadline, tonumber(deadline)) end
  end
  arrival = arrival or now
  if deadline_ms < 0 then deadline_ms = arrival - deadline_ms end  -- a budget (see park.lua)
  if mode == 'claim' and not known then
    local claimed = redis.call('HGET', k(1, 9), waiter)
    local again = 2  -- no claim of the waiter on record (see park.lua)
    if claimed then again = (delivery ~= '' and claimed == delivery) and 1 or 0 end
    return {-2, again, now, 0}
  end

  local function take_all(out)
    local expires_at_ms = now + lease_ms
    for i = 1, count do
      if reserved[i] and delivery ~= '' then
        redis.call('HSET', k(i, 9), waiter, delivery)
        redis.call('PEXPIRE', k(i, 9), room_ttl_ms)
      end
    end
    many_leave(sems, waiter)
    for i = 1, count do
      units_add(k(i, 1), token, sems[i].weight, expires_at_ms)
      redis.call('HSET', k(i, 2), token, now .. '|' .. metadata)
      -- Each on its own: a holders hash made after the set has no TTL of its own yet.
      keep_ttl(k(i, 1), lease_ms, 2 * lease_ms)
      keep_ttl(k(i, 2), lease_ms, 2 * lease_ms)
    end
    local reply = {1, expires_at_ms, now, 0}
    for _, value in ipairs(out) do reply[#reply + 1] = value end
    return reply
  end

  -- Every one takes it at once: it has room and nobody ahead, or a reservation for it.
  local all = true
  for i = 1, count do
    if not reserved[i] then
      local head = redis.call('ZRANGE', k(i, 4), 0, 0)
      if redis.call('ZCARD', k(i, 1)) + sems[i].weight > sems[i].limit
          or (#head > 0 and head[1] ~= waiter) then
        all = false
        break
      end
    end
  end
  if all then return take_all({}) end

  if not known and max_queued > 0 then
    for i = 1, count do
      if redis.call('ZCARD', k(i, 4)) >= max_queued then
        return {-1, redis.call('ZCARD', k(i, 4)), now, i}
      end
    end
  end
  -- Wait in every room at the same place (a waiter parked before keeps its first arrival, and
  -- where it was passive it stays so), with the record of all its keys, which a room's
  -- hand-off reads to tell it from a one-key waiter.
  local needs = {}
  for i = 1, count do needs[i] = k(i, 1) end
  needs = cjson.encode(needs)
  local give_up_at = (deadline_ms > 0 and not known) and deadline_ms or kept_deadline
  local out = {}
  for i = 1, count do
    local tag = sems[i].weight > 1 and ('#' .. sems[i].weight) or ''
    redis.call('HSET', k(i, 5), waiter, arrival .. tag .. '|' .. payload, '!m:' .. waiter, needs,
      '!limit', given[i], '!ttl', room_ttl_ms)
    if not reserved[i] and not passive[i] then many_requeue(sems[i], waiter, arrival, out) end
    if give_up_at > 0 then redis.call('ZADD', k(i, 6), give_up_at, waiter) end
  end
  local holds_all = many_settle(sems, waiter, arrival, claim_ms, now, out)
  for i = 1, count do room_keep(k(i, 4), k(i, 5), k(i, 6), room_ttl_ms) end
  if holds_all then return take_all(out) end
  local reply = nil
  for i = 1, count do
    local rank = redis.call('ZRANK', k(i, 4), waiter)
    if rank and not reply then reply = {0, rank, now, i} end
  end
  reply = reply or {0, 0, now, 1}
  for _, value in ipairs(out) do reply[#reply + 1] = value end
  return reply
end
