-- room: the waiting room's shared steps, for the scripts that say "--! uses: room" (park,
-- claim, release, sweep, cancel, set_limit, ...). Not a script of its own.
--
--! uses: clock rates limit
--
-- Keys of one semaphore (one hash tag, so one cluster slot):
--   slots    sorted set: holder token -> lease expiry (ms); a reservation is "~<waiter>". A
--            holder of weight w > 1 has w members: its token, then "<token>#2".."<token>#w",
--            all with the same expiry, so the set's size is the units in use
--   holders  hash: token -> "<acquired_at_ms>|<metadata JSON>"
--   limits   hash: "limit" -> a live limit an operator set, "set_at" -> when (ms), "by" -> who;
--            it overrides the callers' limit while it exists; "paused_at" -> when (ms) an
--            operator paused the key, "paused_by" -> who: while paused, the limit that
--            applies is 0 (set_limit.lua); a back-off's cool-down and an adaptive limit
--            (adapt.lua, limit.lua); start rates' state (rates.lua)
--   room     sorted set: waiter id -> arrival (ms); the oldest is served first
--   parked   hash: waiter id -> "<arrival_ms>[#<weight>][@<place>][r<units>]|<payload>" (a
--            weight above 1; the place of a waiter parked with a tenant or a head start,
--            when not its arrival; its units of each rate that are not 1, "<name>=<u>,..."),
--            plus "!limit" -> the limit the last parking caller gave (a live limit, when
--            set, overrides it), "!rates" -> the start rates it gave (see rates.lua),
--            "!g:<tenant>" -> the
--            last turn given to a tenant, "!ttl" -> how long the room outlives its
--            last touch (ms, room_keep), "!scan" -> where sweep.lua's backstop scan
--            stands, "!due" -> when the room's next sweep comes at the latest, as far as
--            the room knows (epoch ms: its last sweep's answer, or a mark since; see
--            room_bring_on); and for a
--            waiter that needs several keys (park_many.lua), which waits in each of
--            their rooms at once: "!m:<waiter>" ->
--            the JSON list of the slots keys of all of them, "!p:<waiter>" while it is
--            passive here and "!h:<waiter>" once it holds what it is given (see many.lua)
--   deadlines  sorted set: waiter id -> when it gives up waiting (ms), for waiters with a
--            time budget (sweep.lua sends them their give-up); and "~<waiter>" -> when the
--            reservation a hand-off made for it lapses, so a sweep finds the waiters whose
--            reservation went without reading the whole room (room_reserve)
--   blocked  sorted set: token of a caller blocked in BLPOP on "wake" -> when it stops (ms)
--   wake     list: one element pushed per freed slot that no parked waiter took, to wake one
--            blocked caller (Semaphore.acquire with wait=...)
--   claims   hash: waiter id -> the id of the message whose run claimed its hand-off, and
--            "\n<token>" the slot that run took (waiter.lua; a waiter of several keys: the id
--            only), so a redelivery of that message is told from a duplicate copy
--
-- A reservation holds a slot for one waiter, so the limit counts it like any holder; the
-- waiter's run claims it when it starts (park.lua), or it lapses after the claim lease and
-- the waiter goes back into the room at its old arrival time: nothing is lost, and the order
-- is kept. (A plain acquire, which does not know the room, may prune a lapsed reservation
-- without requeueing it; sweep.lua finds such waiters by the reservation's "~<waiter>" in
-- deadlines once it is due.)
--
-- A waiter that needs several keys is reserved the same way in each of its rooms, but its
-- run can start only once it holds them all, and a script of one key cannot see the others
-- (on Redis Cluster a script touches only the keys it is given). So a room's hand-off
-- answers {"!<waiter>", <its "!m:" record>} for it instead of the payload, and marks the
-- reservation "waiting": whoever made the call runs gather.lua with all of those keys, which
-- decides whether it keeps the units (many.lua) and hands it off once every key holds a
-- reservation for it. A passive one is out of the room's order (not in `room`), keeping its
-- place in the parked hash: the steps here pass it by.

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

-- The payload of a parked entry "<arrival_ms>[#<weight>][@<place>][r<units>]|<payload>".
local function payload_of(entry)
  return string.sub(entry, string.len(string.match(entry, '^[^|]*|')) + 1)
end

-- Where a parked waiter stands in the room: its fair turn, else its arrival (nil: unknown).
local function place_of(parked, waiter)
  local entry = redis.call('HGET', parked, waiter)
  if not entry then return nil end
  local head = string.match(entry, '^[%d#@.]+')
  return tonumber(string.match(head, '@([%d.]+)')) or tonumber(string.match(head, '^(%d+)'))
end

-- The weight of a parked entry: how many units its run takes.
local function weight_of(entry)
  return tonumber(string.match(string.match(entry, '^[%d#@.]+'), '#(%d+)')) or 1
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

-- Keep the room's keys alive for their TTL ("!ttl", which park.lua records) from now, when
-- less than half of it is left: a room lives while anyone parks, claims, releases into or
-- sweeps it, however long its backlog takes to drain, and an abandoned one (nobody touched
-- it for a whole TTL) still goes away. About one PEXPIRE per half TTL on a busy room.
-- A park passes its `ttl` and may just have made the room's sorted sets anew (a room whose
-- waiters were all reserved, a first deadline): then each key is looked at; elsewhere the
-- parked hash speaks for all three, which only a park or room_requeue creates.
local function room_keep(room, parked, deadlines, ttl)
  local keys = {parked}
  if ttl then
    keys = {room, parked, deadlines}
  else
    ttl = tonumber(redis.call('HGET', parked, '!ttl'))
    if not ttl then return end
  end
  for _, key in ipairs(keys) do
    local left = redis.call('PTTL', key)
    if left == -1 or (left >= 0 and left < ttl / 2) then
      redis.call('PEXPIRE', room, ttl)
      redis.call('PEXPIRE', parked, ttl)
      redis.call('PEXPIRE', deadlines, ttl)
      return
    end
  end
end

-- The "~sweep" mark's payload for the room of `slots`: the room index's key, when its
-- sweep is due (epoch ms; 0: now), and the semaphore key (replies.py's SweepDue).
local function room_sweep_mark(slots, due)
  local prefix, key = string.match(slots, '^(.-):{(.*)}$')
  return prefix .. ':rooms ' .. due .. ' ' .. key
end

-- Make sure the room is swept by `at` (epoch ms): when its next sweep may come later (by
-- "!due"), note `at` there and append the "~sweep" mark to `out`, which asks the caller to
-- bring the room's score in the room index down to `at` (handoff.py's delivery). The room
-- index lives apart from the room (on a cluster, on another node), so no script can write
-- it; "!due" spares the caller that write whenever a sweep is due soon enough already.
local function room_bring_on(slots, parked, at, out)
  local due = tonumber(redis.call('HGET', parked, '!due'))
  if due and due <= at then return end
  redis.call('HSET', parked, '!due', at)
  out[#out + 1] = '~sweep'
  out[#out + 1] = room_sweep_mark(slots, at)
end

-- Delete a room nobody is left in (no waiter in line, no reservation or passive turn noted
-- in its deadlines, no parked entry but the room's own "!" marks): true when it did. A key
-- with no room takes its slots on park.lua's short path again.
local function room_close_if_empty(room, parked, deadlines)
  if redis.call('ZCARD', room) > 0 or redis.call('ZCARD', deadlines) > 0 then return false end
  for _, field in ipairs(redis.call('HKEYS', parked)) do
    if string.sub(field, 1, 1) ~= '!' then return false end
  end
  redis.call('DEL', room, parked, deadlines)
  return true
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

-- Reserve `weight` units of `slots` for `waiter` until `expires` (ms), and note when the
-- reservation lapses in `deadlines`, where a sweep looks at it then (sweep.lua). A
-- deadlines set this makes lives as long as the parked hash, as room_requeue's room does.
local function room_reserve(slots, deadlines, parked, waiter, weight, expires)
  units_add(slots, '~' .. waiter, weight, expires)
  redis.call('ZADD', deadlines, expires, '~' .. waiter)
  if redis.call('PTTL', deadlines) == -1 then
    local ttl = redis.call('PTTL', parked)
    if ttl > 0 then redis.call('PEXPIRE', deadlines, ttl) else
      redis.call('PEXPIREAT', deadlines, expires) end
  end
end

-- Reserve free slots for the oldest waiters, in strict order: a head whose weight does not
-- fit waits, and nobody behind it is served first. Append {waiter, payload} pairs to out,
-- or {"!<waiter>", keys} for a waiter that needs several keys (see the top of this file).
--
-- Under start rates ("!rates"), each reservation also takes its waiter's units of every
-- rate, for the first instant the rates allow (rates.lua), recorded as the reservation's
-- "start" (park.lua's claim gives a run that comes too late for it a new one); a start in
-- the future is reserved until then plus the claim lease, and answered as
-- {">" .. <start, epoch ms> .. "|" .. <waiter>, payload}, for the caller to publish to
-- start then (an instant, not a delay: a publish that comes late does not move
-- the start later, where it would crowd the next one). A waiter of several keys is not
-- held to rates. The rates are read at the first reservation: a call that reserves
-- nothing (most releases into a full room) does not read them.
local function room_hand_off(slots, holders, room, parked, deadlines, limit, claim_ms, now,
                             out)
  if claim_ms <= 0 then return end
  if limit == 0 then
    -- Cooling down after a back-off: nothing is handed out before it ends, and nothing may
    -- happen then to hand the slots out but a sweep of the room, which must come then.
    local _, _, cool = live_limit(slots .. ':limits', nil)
    if cool and redis.call('ZCARD', room) > 0 then room_bring_on(slots, parked, cool, out) end
    return
  end
  local first, rates = nil, nil
  while redis.call('ZCARD', slots) < limit do
    local head = redis.call('ZRANGE', room, 0, 0)
    if #head == 0 then break end
    local waiter = head[1]
    local entry = redis.call('HGET', parked, waiter)
    if entry then
      local weight = weight_of(entry)
      if redis.call('ZCARD', slots) + weight > limit then break end
      local keys = redis.call('HGET', parked, '!m:' .. waiter)
      local start = now
      if rates == nil then rates = room_rates(slots, parked, now) or false end
      if rates and not keys then
        local units = rate_units_of(entry)
        start = rates_start(rates, units, now)
        rates_take(slots .. ':limits', rates, units, start, now)
      end
      room_reserve(slots, deadlines, parked, waiter, weight, start + claim_ms)
      local record = {reserved_for = waiter, limit = limit}
      if weight > 1 then record.weight = weight end
      if keys then record.waiting = true end
      if rates and not keys then record.start = start end
      redis.call('HSET', holders, '~' .. waiter, now .. "|" .. cjson.encode(record))
      local name = waiter
      if keys then name = '!' .. waiter elseif start > now then
        name = '>' .. start .. '|' .. waiter
      end
      out[#out + 1] = name
      out[#out + 1] = keys or payload_of(entry)
      first = math.min(first or start, start)
    end
    redis.call('ZREM', room, waiter)
  end
  -- A reservation that goes without a claim is put right by the sweep at its lapse, which
  -- the room may be scored for later than that (a still room's sweep comes a quarter TTL
  -- on): bring it on.
  if first then room_bring_on(slots, parked, first + claim_ms, out) end
  keep_ttl(slots, claim_ms, claim_ms)
  -- The reservations' records: a holders hash made here has no TTL of its own yet.
  if first then keep_ttl(holders, claim_ms, claim_ms) end
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
