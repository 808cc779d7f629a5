-- park: a run that finds its key full waits in the key's room, in arrival order: it takes a
-- slot only when no older waiter is parked, else it parks with its payload (its message),
-- which a release hands to whoever publishes it once a slot is reserved for it.
--
-- KEYS and ARGV[1..5], ARGV[7]: see waiter.lua
-- ARGV[6]  payload  what to hand to whoever publishes the waiter (opaque), or "" to keep the
--                   one it parked with
-- ARGV[8]  place    where and how it waits, a JSON object:
--            "arrival_ms"  when it first asked (epoch ms), or null for now, or -<ms>: that
--                          long before now by this server's clock; a waiter already parked
--                          keeps its first arrival
--            "deadline_ms" when a newly parked waiter gives up waiting (epoch ms), or 0, or
--                          -<ms>: that long after its arrival, by this server's clock
--            "max_queued"  refuse to park past this many waiters (0: no limit)
--            "tenant"      its fair-turn tenant ("" for none): it parks at its tenant's turn,
--                          one past the tenant's last and after the room's head,
--                          instead of at its arrival; so a tenant with many waiters takes
--                          turns with one that has few
--            "ahead_ms"    a head start (>= 0): a newly parked waiter stands that many ms
--                          before its arrival, so it passes waiters that came less than that
--                          long before it and no older one; with a tenant, that many turns
--                          before its turn, always after the room's head
--            "rates"       the key's start rates, "<name> <interval_ms> <burst> ..." ("":
--                          none; see rates.lua), recorded as the room's "!rates"
--            "units"       the waiter's units of each rate that are not 1, "<name>=<u>,..."
--
-- Returns now_ms or {2, expires_at_ms, now_ms, limit}   the key had no room and the waiter
--                                                        took a free slot (free.lua)
--         {1, expires_at_ms, now_ms, limit, hand-offs...}  the waiter holds a slot
--         {0, position, now_ms, limit, hand-offs...}      parked; position 0 is next served
--         {-1, queued, now_ms, limit}                      the room is full (max_queued)
-- limit is the one that applied; hand-offs are {waiter, payload} pairs for slots freed here
-- and reserved for older waiters; the caller publishes them.
--
-- A key with no room has nobody parked or reserved: the waiter would be alone in the room,
-- so it takes a free slot as a plain acquire would, without joining the room, and only a
-- full key (or a token already there) goes on to join it. Joining comes before any free slot
-- is handed out, so the waiter is served in arrival order with everyone else.
--! uses: waiter free
local place = cjson.decode(ARGV[8])
local rate_list, units = {}, {}
for item in string.gmatch(place.rates, '%S+') do rate_list[#rate_list + 1] = item end
for name, u in string.gmatch(place.units, '([%w_]+)=(%d+)') do units[name] = tonumber(u) end
if redis.call('EXISTS', KEYS[4], KEYS[5]) == 0 then
  local rates = #rate_list > 0 and rates_read(KEYS[3], rate_list, 1, #rate_list / 3, 3, now_ms()) or nil
  local taken = free_take(KEYS[1], KEYS[3], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3],
    tonumber(ARGV[4]) or 1, rates, units)
  if taken then return taken end
end

local w = waiter_of('')
local held = waiter_held(w)
-- Reserved for a start rate's instant still to come: its hand-off starts it then.
if held and held[1] == -2 then return {0, 0, w.now, w.limit} end
if held then return held end

local waiter, parked, room, now = w.waiter, w.parked, w.room, w.now
local payload, ahead_ms, tenant = ARGV[6], place.ahead_ms, place.tenant
-- A negative arrival is a wait the caller measured itself (ms before now), and a negative
-- deadline a budget counted from the arrival: both then stand on this server's clock, not
-- on the caller's, which may be off.
local arrival = tonumber(place.arrival_ms) or now
if arrival < 0 then arrival = now + arrival end
local deadline_ms = place.deadline_ms
if deadline_ms < 0 then deadline_ms = arrival - deadline_ms end
local known = arrival_of(parked, waiter)
if not known and place.max_queued > 0 and redis.call('ZCARD', room) >= place.max_queued then
  return {-1, redis.call('ZCARD', room), now, w.limit}
end
if known then
  arrival = known
  if payload == '' then payload = payload_of(redis.call('HGET', parked, waiter)) end
end
local at = known and place_of(parked, waiter) or arrival
local tag = w.weight > 1 and ('#' .. w.weight) or ''
-- Parked before at a fair turn or with a head start: it keeps its place.
local turned = known and at ~= known
if tenant ~= '' or turned or (ahead_ms > 0 and not known) then
  if not known and tenant ~= '' then
    -- Fair turns: one past the tenant's last turn, and after the room's head, so a tenant
    -- that arrives late is served next to the one with the long backlog. Half a turn after
    -- it, not at it: a tie with the head would go by id, and a newcomer could pass the run
    -- served next; half a turn keeps the newcomer's turns between the backlog's.
    local head = redis.call('ZRANGE', room, 0, 0, 'WITHSCORES')
    local first = head[2] and tonumber(head[2]) + 0.5 or arrival
    local last = tonumber(redis.call('HGET', parked, '!g:' .. tenant))
    at = math.max(first, last and last + 1 or 0)
    redis.call('HSET', parked, '!g:' .. tenant, at)
    -- A head start moves this waiter only (the tenant's next turn stays), and never before
    -- the head: the head's place then never falls, so no head start passes a waiter more
    -- than ahead_ms turns of each tenant.
    at = math.max(first, at - ahead_ms)
  elseif not known then
    -- By arrival: a waiter is passed only by those that came less than ahead_ms after it.
    at = math.max(at - ahead_ms, 0)
  end
  tag = tag .. '@' .. at
end
if place.units ~= '' then tag = tag .. 'r' .. place.units end
redis.call('HSET', parked, waiter, arrival .. tag .. '|' .. payload, '!limit', w.given,
  '!ttl', w.ttl_ms)
if #rate_list > 0 then
  redis.call('HSET', parked, '!rates', place.rates)
else
  redis.call('HDEL', parked, '!rates')
end
redis.call('ZADD', room, at, waiter)
if deadline_ms > 0 and not known then redis.call('ZADD', w.deadlines, deadline_ms, waiter) end
return waiter_serve(w)
