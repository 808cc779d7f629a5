-- park: take a slot for a waiter in arrival order, or park it in the waiting room; or, in
-- claim mode, take the slot reserved for it by a hand-off.
--
-- KEYS[1..9]  slots, holders, limits, room, parked, deadlines, blocked, wake, claims (see
--             room.lua)
-- ARGV[1]  limit        the key's limit (integer >= 1); a live limit, when set, wins
-- ARGV[2]  lease_ms     lease of the slot taken (integer >= 1)
-- ARGV[3]  token        unique per acquisition: the holder's member, its record in itself
--                       ("<token>|<acquired_at_ms>|<metadata JSON>", process.py)
-- ARGV[4]  weight       how many units of the limit the waiter takes (integer >= 1)
-- ARGV[5]  mode         "park"; "claim" (take only a reservation; never park anew); or
--                       "take" (take a free slot of a key with no room, else do nothing:
--                       the caller then parks with the rest of the arguments; only ARGV[1]
--                       to ARGV[5] are sent)
-- ARGV[6]  waiter       the waiter's id (a task id); never starts with "~" or "!"
-- ARGV[7]  arrival_ms   when it first asked (epoch ms), or "" for now, or -<ms>: that long
--                       before now by this server's clock; a waiter already parked keeps
--                       its first arrival
-- ARGV[8]  claim_ms     how long a hand-off's reservation waits for its run (integer >= 1)
-- ARGV[9]  room_ttl_ms  how long a room outlives its last touch (integer >= 1): recorded as
--                       its "!ttl", which every room script renews (room_keep)
-- ARGV[10] max_queued   refuse to park past this many waiters (0: no limit)
-- ARGV[11] deadline_ms  when a newly parked waiter gives up waiting (epoch ms), or 0, or
--                       -<ms>: that long after its arrival, by this server's clock
-- ARGV[12] grace_ms     a reservation its run has not claimed within this long may be taken
--                       by this waiter, which is here now (0: never)
-- ARGV[13] delivery     claim mode: an id of the message this run came in ("" if none),
--                       recorded with the claim
-- ARGV[14] group        a fair-turn group ("" for none): a waiter of a group parks at its
--                       turn, one past its group's last, and no earlier than the room's
--                       head, instead of at its arrival; so a group with many waiters takes
--                       turns with one that has few
-- ARGV[15] ahead_ms     a head start (integer >= 0): a newly parked waiter stands that
--                       many ms before its arrival, so it passes waiters that came less
--                       than that long before it and no older one; with a group, that
--                       many turns before its turn, never before the room's head (the
--                       group's next turn is not moved)
-- ARGV[16] payload      what to hand to whoever publishes it (opaque), or "" to keep the
--                       parked one
-- ARGV[17] rates        the key's start rates, "<name> <interval_ms> <burst> ..." ("" or
--                       absent: none; see rates.lua), recorded as the room's "!rates"
-- ARGV[18] units        the waiter's units of each rate that are not 1, "<name>=<u>,..."
--
-- Returns now_ms                                            the key had no room and the
--                                                     waiter took a new slot under ARGV[1]
--                                                     (expiring at now_ms + lease_ms)
--         {2, expires_at_ms, now_ms, limit}                  the same, under a live limit
--         {1, expires_at_ms, now_ms, limit, hand-offs...}   the waiter holds a slot (token)
--         {0, position, now_ms, limit, hand-offs...}        parked; position 0 is next served
--         {-1, queued, now_ms, limit}                        the room is full (max_queued)
--         {-2, again, now_ms, limit}                         claim mode: nothing reserved or parked
--                                                     for this waiter; again is 2 when no
--                                                     claim of it is on record, 1 when this
--                                                     very delivery claimed a slot before (the
--                                                     broker delivered it again: its run was
--                                                     lost), 0 for another copy (a duplicate)
--         {-3, 0, 0, 0}                                      take mode: the key has a room, or no
--                                                     free slot, or the token is there
--                                                     already; nothing was done
--         {-4, wait_ms, now_ms, limit}                       claim mode: the reservation starts
--                                                     wait_ms from now (a start rate's
--                                                     instant, which this run came early for)
-- limit is the one that applied; hand-offs are {waiter, payload} pairs for slots freed here
-- and reserved for older waiters; the caller publishes them.
--
-- The waiter joins the room before any free slot is handed out, so it is served in arrival
-- order with everyone else: a free slot goes to it only if no older waiter is parked.
local slots, holders, limits, room, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local given = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local token, waiter = ARGV[3], ARGV[6]
local weight = tonumber(ARGV[4]) or 1

if redis.replicate_commands then pcall(redis.replicate_commands) end
-- A key with no room has nobody parked or reserved: the waiter would be alone in the room,
-- so it takes a free slot as a plain acquire would, without joining the room, and only a
-- full key (or a token already there) goes on to the room's steps, below, which are not
-- even defined on this path. The take mode goes no further: a caller that finds a free slot
-- there has not made or sent the payload it would park with.
local mode = ARGV[5]
-- The key's start rates, and this waiter's units of each (rates.lua).
local rate_list, units = {}, {}
for item in string.gmatch(ARGV[17] or '', '%S+') do rate_list[#rate_list + 1] = item end
for name, u in string.gmatch(ARGV[18] or '', '([%w_]+)=(%d+)') do units[name] = tonumber(u) end
if mode ~= 'claim' and redis.call('EXISTS', room, parked) == 0 then
  local set = redis.call('HMGET', limits, 'limit', 'paused_at')  -- paused: 0
  local limit = set[2] and 0 or tonumber(set[1]) or given
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local rates = #rate_list > 0 and rates_read(limits, rate_list, 1, #rate_list / 3, 3)
  if rates and rates_start(rates, units, now) > now then
    limit = 0  -- not yet: the waiter parks, and the room hands it its start
  end
  if redis.call('ZCARD', slots) + weight <= limit
      and redis.call('ZADD', slots, 'NX', now + lease_ms, token) == 1 then
    if rates then rates_take(limits, rates, units, now, now) end
    for i = 2, weight do redis.call('ZADD', slots, now + lease_ms, token .. '#' .. i) end
    -- Twice the lease when below one, as acquire.lua does: a PEXPIRE about once a lease.
    if redis.call('PTTL', slots) < lease_ms then redis.call('PEXPIRE', slots, 2 * lease_ms) end
    if set[1] then return {2, now + lease_ms, now, limit} end  -- a live limit applied
    return now
  end
end
if mode == 'take' then return {-3, 0, 0, 0} end
--[[room.lua]]
local deadlines, blocked, wake, claims = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local limit = live_limit(limits, given)
local payload, claim_ms = ARGV[16], tonumber(ARGV[8])
local room_ttl_ms, max_queued = tonumber(ARGV[9]), tonumber(ARGV[10])
local deadline_ms, grace_ms, delivery = tonumber(ARGV[11]), tonumber(ARGV[12]), ARGV[13]
local group, ahead_ms = ARGV[14] or '', tonumber(ARGV[15]) or 0

local now = room_now_ms()
local arrival = tonumber(ARGV[7]) or now
-- A negative arrival is a wait the caller measured itself (ms before now), and a negative
-- deadline a budget counted from the arrival: both then stand on this server's clock, not
-- on the caller's, which may be off.
if arrival < 0 then arrival = now + arrival end
if deadline_ms < 0 then deadline_ms = arrival - deadline_ms end
room_prune(slots, holders, room, parked, now)
-- The room hands slots out by the limit its callers give now (one computed per run may
-- change): every park and claim brings it up to date.
if redis.call('HEXISTS', parked, '!limit') == 1 then redis.call('HSET', parked, '!limit', given) end

-- Take a slot for the waiter, in place of `member` (a reservation of `units`), if any.
local function take(member, units)
  local waited = member == '~' .. waiter or redis.call('HEXISTS', parked, waiter) == 1
  if member then
    units_remove(slots, member, units)
    redis.call('HDEL', holders, member)
  end
  if waited then
    -- Which message took the waiter's turn ("~": one that asked in person): if the broker
    -- delivers that one again, its run was lost; any other copy is a duplicate; and no
    -- record at all means the store lost it (a restart).
    redis.call('HSET', claims, waiter, delivery ~= '' and delivery or '~')
    redis.call('PEXPIRE', claims, room_ttl_ms)
  end
  redis.call('ZREM', room, waiter)
  redis.call('HDEL', parked, waiter, '!m:' .. waiter, '!p:' .. waiter, '!h:' .. waiter)
  redis.call('ZREM', deadlines, waiter, '~' .. waiter)
  room_keep(room, parked, deadlines)
  local expires_at_ms = now + lease_ms
  units_add(slots, token, weight, expires_at_ms)
  if redis.call('PTTL', slots) < lease_ms then redis.call('PEXPIRE', slots, 2 * lease_ms) end
  return expires_at_ms
end

local mine = redis.call('ZSCORE', slots, token)
if mine then return {1, tonumber(mine), now, limit} end
if redis.call('ZSCORE', slots, '~' .. waiter) then
  -- A reservation for a start rate's instant: a run that came early (its worker's clock
  -- ahead of this server's) waits for it.
  local record = redis.call('HGET', holders, '~' .. waiter) or ''
  local start = tonumber(string.match(record, '"start":(%d+)'))
  if start and start > now then return {-4, start - now, now, limit} end
  -- One that comes later than its slack (its worker was busy) would start right beside the
  -- run given the next instant: it takes its units again, at the first instant free now,
  -- and the instant it missed stays spent (the bound holds by the bodies' clocks too).
  local rates = start and room_rates(slots, parked)
  local entry = rates and redis.call('HGET', parked, waiter)
  local late = entry and rate_units_of(entry)
  if entry and now - start > rates_slack(rates, late) then
    start = rates_start(rates, late, now)
    rates_take(limits, rates, late, start, now)
    redis.call('HSET', holders, '~' .. waiter,
      (string.gsub(record, '"start":%d+', '"start":' .. start, 1)))
    if start > now then
      room_reserve(slots, KEYS[6], parked, waiter, weight_of(entry), start + claim_ms)
      return {-4, start - now, now, limit}
    end
  end
  local claimed = {1, take('~' .. waiter, nil), now, limit}
  -- The last run of a drained room: the room goes now, not at its next sweep.
  room_close_if_empty(room, parked, deadlines)
  return claimed
end

local known = arrival_of(parked, waiter)
if mode == 'claim' and not known then
  local claimed = redis.call('HGET', claims, waiter)
  local again = 2  -- no claim of the waiter on record (the store may have lost it)
  if claimed then again = (delivery ~= '' and claimed == delivery) and 1 or 0 end
  return {-2, again, now, limit}
end
if not known and max_queued > 0 and redis.call('ZCARD', room) >= max_queued then
  return {-1, redis.call('ZCARD', room), now, limit}
end
if known then
  arrival = known
  if payload == '' then
    local entry = redis.call('HGET', parked, waiter)
    payload = payload_of(entry)
  end
end
-- The caller's own limit: release and sweep fall back on it once a live limit is cleared.
local place = known and place_of(parked, waiter) or arrival
local tag = weight > 1 and ('#' .. weight) or ''
-- Parked before at a fair turn or with a head start: it keeps its place.
local turned = known and place ~= known
if group ~= '' or turned or (ahead_ms > 0 and not known) then
  if not known and group ~= '' then
    -- Fair turns: one past the group's last turn, and no earlier than the room's head, so a
    -- group that arrives late is served next to the one with the long backlog.
    local head = redis.call('ZRANGE', room, 0, 0, 'WITHSCORES')
    local first = head[2] and tonumber(head[2]) or arrival
    local last = tonumber(redis.call('HGET', parked, '!g:' .. group))
    place = math.max(first, last and last + 1 or 0)
    redis.call('HSET', parked, '!g:' .. group, place)
    -- A head start moves this waiter only (the group's next turn stays), and never before
    -- the head: the head's place then never falls, so no head start passes a waiter more
    -- than ahead_ms turns of each group.
    place = math.max(first, place - ahead_ms)
  elseif not known then
    -- By arrival: a waiter is passed only by those that came less than ahead_ms after it.
    place = math.max(place - ahead_ms, 0)
  end
  tag = tag .. '@' .. place
end
if (ARGV[18] or '') ~= '' then tag = tag .. 'r' .. ARGV[18] end
redis.call('HSET', parked, waiter, arrival .. tag .. '|' .. payload, '!limit', given,
  '!ttl', room_ttl_ms)
if #rate_list > 0 then
  redis.call('HSET', parked, '!rates', ARGV[17])
elseif mode == 'park' then
  redis.call('HDEL', parked, '!rates')
end
redis.call('ZADD', room, place, waiter)
if deadline_ms > 0 and not known then redis.call('ZADD', deadlines, deadline_ms, waiter) end

local out = {}
room_hand_off(slots, holders, room, parked, deadlines, limit, claim_ms, now, out)
local reply = {0, 0, now, limit}
local others = {}
for i = 1, #out, 2 do
  if out[i] == waiter then
    reply = {1, take('~' .. waiter, nil), now, limit}
  else
    others[#others + 1] = out[i]
    others[#others + 1] = out[i + 1]
  end
end
if reply[1] == 0 and grace_ms > 0 and not redis.call('ZSCORE', slots, '~' .. waiter) then
  -- A reservation not claimed within grace_ms: its run's message is still on its way (behind
  -- a backlog in the broker queue, say) while this run is here now. This run takes the slot
  -- rather than leave it idle; the passed-over waiter keeps its place at the head of the
  -- room, and its message, when it comes, finds it parked and waits for the next hand-off.
  -- Never a reservation of a waiter that needs several keys: it holds it while it waits for
  -- its other keys (no message is on its way), and taking it would undo what it gathered.
  -- Under start rates this run takes its own units now (the passed-over one's went with
  -- its instant), or nothing: every start stands on a unit of its own at its own instant.
  -- (A waiter this very call reserved a later instant for is not here for a slot now.)
  local stale = redis.call('ZRANGEBYSCORE', slots, '-inf', now + claim_ms - grace_ms)
  local rates = #stale > 0 and #rate_list > 0
    and rates_read(limits, rate_list, 1, #rate_list / 3, 3)
  for _, member in ipairs(stale) do
    if string.sub(member, 1, 1) == '~' and not string.find(member, '#', 1, true)
        and redis.call('HEXISTS', parked, '!m:' .. string.sub(member, 2)) == 0 then
      local passed = string.sub(member, 2)
      local entry = redis.call('HGET', parked, passed)
      local held = entry and weight_of(entry) or 1
      -- Only a reservation that frees room enough for this waiter's weight.
      if redis.call('ZCARD', slots) - held + weight <= limit
          and (not rates or rates_start(rates, units, now) <= now) then
        if rates then rates_take(limits, rates, units, now, now) end
        room_requeue(room, parked, place_of(parked, passed) or now, passed)
        reply = {1, take(member, held), now, limit}
        break
      end
    end
  end
end
-- A waiter handed a start in the future has left the line: it is next.
if reply[1] == 0 then reply[2] = redis.call('ZRANK', room, waiter) or 0 end
for _, value in ipairs(others) do reply[#reply + 1] = value end
room_keep(room, parked, deadlines, room_ttl_ms)
return reply
