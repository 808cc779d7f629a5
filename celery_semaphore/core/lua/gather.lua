-- gather: hand off a waiter that needs several keys once it holds a reservation of each.
-- A room's hand-off sees one key only: when it reserves units for such a waiter it answers
-- {"!<waiter>", <its keys>} in place of the payload (see room.lua), and whoever made that call
-- runs this script with all of those keys (one hash slot on Redis Cluster, as park_many.lua
-- requires), so that no script ever touches a key it was not given.
--
-- KEYS[6i-5..6i]  slots, holders, limits, room, parked, deadlines of each key the waiter
--                 needs (see room.lua)
-- ARGV[1]  waiter    the waiter's id
-- ARGV[2]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1)
--
-- Returns {hand-offs...}: {waiter, payload} pairs to publish, this waiter's among them when
-- it is handed off now; and {"!<waiter>", keys} of other waiters of several keys that these
-- keys' rooms reserved for just now (the caller gathers them in turn).
--
-- Every room first serves its own order, and many.lua's steps decide what the waiter holds.
-- When it holds a reservation of every key and one of them is still marked "waiting", all
-- of them get a fresh claim lease, lose the mark, and the waiter is handed off: once,
-- however many of its rooms asked. A waiter missing from one of its rooms (a room that
-- expired, a waiter parked by an older version) is handed off as it stands: its run's claim
-- parks it there again. One gone from all of them (it took its slots, or was cancelled) is
-- left alone.
--! uses: many
local waiter, claim_ms = ARGV[1], tonumber(ARGV[2])
local count = #KEYS / 6
local function k(i, n) return KEYS[6 * (i - 1) + n] end
local now = now_ms()

local sems, payload, place, missing = {}, nil, nil, false
for i = 1, count do
  local slots, holders, room, parked = k(i, 1), k(i, 2), k(i, 4), k(i, 5)
  local limit = room_limit(k(i, 3), parked)
  local entry = redis.call('HGET', parked, waiter)
  if limit and entry then
    room_keep(room, parked, k(i, 6))
    room_prune(slots, holders, room, parked, now)
    payload, place = payload or payload_of(entry), place or place_of(parked, waiter)
    if not redis.call('ZSCORE', room, waiter) and not redis.call('ZSCORE', slots, '~' .. waiter)
        and redis.call('HEXISTS', parked, '!p:' .. waiter) == 0 then
      room_requeue(room, parked, place, waiter)  -- a plain acquire pruned its reservation
    end
    sems[#sems + 1] = {slots = slots, holders = holders, room = room, parked = parked,
                       deadlines = k(i, 6), limit = limit, weight = weight_of(entry)}
  else
    missing = true
  end
end
if not payload then return {} end
local out = {}
if missing then
  out[#out + 1] = waiter
  out[#out + 1] = payload
  return out
end
if not many_settle(sems, waiter, place, claim_ms, now, out) then return out end
local waiting = false
for _, s in ipairs(sems) do
  waiting = waiting or string.find(redis.call('HGET', s.holders, '~' .. waiter) or '',
    '"waiting"', 1, true) ~= nil
end
if not waiting then return out end  -- handed off already
for _, s in ipairs(sems) do
  local at, record = string.match(redis.call('HGET', s.holders, '~' .. waiter) or '',
    '^(%d+)|(.*)$')
  record = record and cjson.decode(record) or {reserved_for = waiter, limit = s.limit}
  record.waiting = nil
  room_reserve(s.slots, s.deadlines, s.parked, waiter, s.weight, now + claim_ms)
  redis.call('HSET', s.holders, '~' .. waiter, (at or now) .. '|' .. cjson.encode(record))
  keep_ttl(s.slots, claim_ms, claim_ms)
  keep_ttl(s.holders, claim_ms, claim_ms)
end
out[#out + 1] = waiter
out[#out + 1] = payload
return out
