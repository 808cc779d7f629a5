-- sweep: the waiting room's safety net, run on a timer by every worker of the app.
--
-- KEYS[1..8]  slots, holders, limits, room, parked, deadlines, blocked, wake (see room.lua)
-- ARGV[1]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1)
-- ARGV[2]  idle_ms   the longest a room where nothing falls due goes unswept (integer >= 1;
--                    at most a quarter of the room's TTL, "!ttl", whose keys it keeps alive)
--
-- Returns {alive, hand-offs, give-ups, next_ms}: alive is 0 once the room is gone (nothing
-- parked); hand-offs and give-ups are flat {waiter, payload, ...} lists the caller
-- publishes; next_ms is when the room next needs a sweep, epoch ms by the server's clock
-- (see below), for the caller to score the room with in the room index.
--
-- Frees lapsed holders and reservations, puts back into the room any waiter whose
-- reservation went without a claim (a plain acquire pruned it) and that is not passive (a
-- waiter of several keys that let this room serve others first: see many.lua), and hands
-- every free slot to the oldest waiters. So a room drains even when every process that
-- would have released a slot died, and a hand-off whose message was lost is published again
-- once its reservation lapses.
--
-- A waiter still in the room past its deadline is given up: its payload is returned for the
-- caller to publish as a give-up (the run then cancels itself and fails). It stays parked
-- until that run cancels it, and its deadline moves claim_ms ahead, so a give-up whose
-- message was lost is sent again, and a hand-off that comes first still starts it.
--
-- What a sweep reads grows with what fell due, not with the room: lapsed reservations and
-- deadlines are read by score from `deadlines` (room_reserve notes every reservation
-- there), at most DUE per call (the rest at the next sweep). As the backstop for a waiter
-- that stands in no order by any other way (a reservation from before "~" entries), a page
-- of PAGE parked entries is looked over, where the last page left off, at most once per
-- SCAN_EVERY_MS per room whoever sweeps it: "!scan" in the parked hash keeps the scan's
-- cursor and when the next page is due.
--
-- next_ms is the earliest of: the first entry of `deadlines` (a reservation's lapse, a
-- waiter's deadline), the first holder's lease end while anyone waits (a holder that died
-- frees its slot then), and now + idle_ms (less up to a quarter). It is noted as "!due" in
-- the parked hash. What this sweep cannot see brings the room's sweep on itself: a later
-- reservation lapsing before "!due" marks the room (room_bring_on), as does a slot freed
-- for the sweep to hand out; a waiter parked later with a deadline lowers the room's score
-- itself (room_index.py). A holder that takes a slot later took a reservation (its lapse
-- is marked) or a slot that was free while anyone waited, which only a lapse the room is
-- scored for, or a mark, leaves free: the sweep that follows sees the holder, and scores the
-- room with its lease end. So a still room, where nothing falls due, costs one sweep per
-- idle_ms, which only keeps its keys alive. A mark is written by the caller after this
-- script's call, and is lost if the caller dies in between: the room is then swept at the
-- first lease end this sweep saw (at most a lease on, for a holder that renews), or, for a
-- holder whose lease is long, when its release brought the sweep on before it ran (slot.py).
--! uses: room
local slots, holders, limits, room, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local deadlines, blocked, wake = KEYS[6], KEYS[7], KEYS[8]
local claim_ms, idle_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
idle_ms = math.max(1, math.min(idle_ms,
  math.floor((tonumber(redis.call('HGET', parked, '!ttl')) or idle_ms * 4) / 4)))
local DUE, PAGE, SCAN_EVERY_MS = 500, 100, 30000

local now = now_ms()
local limit = room_limit(limits, parked)
if not limit then
  redis.call('DEL', deadlines)
  return {0, {}, {}, -1}
end
room_keep(room, parked, deadlines)
room_prune(slots, holders, room, parked, now)

-- Whether a parked `waiter` stands nowhere: not in the order, reserved, or passive.
local function stray(waiter)
  return not redis.call('ZSCORE', room, waiter)
    and not redis.call('ZSCORE', slots, '~' .. waiter)
    and redis.call('HEXISTS', parked, '!p:' .. waiter) == 0
end

local due = redis.call('ZRANGEBYSCORE', deadlines, '-inf', now, 'LIMIT', 0, DUE)
for _, member in ipairs(due) do
  if string.sub(member, 1, 1) == '~' then
    local waiter = string.sub(member, 2)
    local place = place_of(parked, waiter)
    local held = redis.call('ZSCORE', slots, member)
    if place and held then
      redis.call('ZADD', deadlines, held, member)  -- reserved anew: looked at when it lapses
    elseif place and redis.call('HEXISTS', parked, '!p:' .. waiter) == 1 then
      redis.call('ZADD', deadlines, now + claim_ms, member)  -- passive: it still waits here
    else
      redis.call('ZREM', deadlines, member)
      if place and not redis.call('ZSCORE', room, waiter) then
        room_requeue(room, parked, place, waiter)  -- its reservation went unclaimed
      end
    end
  end
end
local cursor, next_ms = string.match(redis.call('HGET', parked, '!scan') or '',
  '^(%d+)|(%d+)$')
if now >= (tonumber(next_ms) or 0) then
  local scan = redis.call('HSCAN', parked, cursor or '0', 'COUNT', PAGE)
  for i = 1, #scan[2], 2 do
    local waiter = scan[2][i]
    if string.sub(waiter, 1, 1) ~= '!' and stray(waiter) then
      room_requeue(room, parked, place_of(parked, waiter) or now, waiter)
    end
  end
  redis.call('HSET', parked, '!scan', scan[1] .. '|' .. (now + SCAN_EVERY_MS))
end

local out = {}
room_hand_off(slots, holders, room, parked, deadlines, limit, claim_ms, now, out)
-- This sweep scores the room itself, by every lapse it made (below): no mark.
if out[#out - 1] == '~sweep' then
  out[#out] = nil
  out[#out] = nil
end
if redis.call('ZCARD', slots) < limit then room_wake(blocked, wake, now) end
local give_ups = {}
for _, waiter in ipairs(due) do
  if string.sub(waiter, 1, 1) ~= '~' then
    local entry = redis.call('HGET', parked, waiter)
    if not entry then
      redis.call('ZREM', deadlines, waiter)
    else
      -- Given up (or, when reserved or passive now, looked at again): either way once
      -- claim_ms from now, so what is due moves on.
      redis.call('ZADD', deadlines, now + claim_ms, waiter)
      if redis.call('ZSCORE', room, waiter) then
        give_ups[#give_ups + 1] = waiter
        give_ups[#give_ups + 1] = payload_of(entry)
      end
    end
  end
end
-- Every waiter is in the order, or has a reservation or passive turn noted in deadlines: a
-- room with neither has none (the parked hash is read whole only then, to make sure).
if room_close_if_empty(room, parked, deadlines) then return {0, out, give_ups, -1} end
-- Each room idles a little less than idle_ms, by an amount of its own: rooms made together
-- (a burst of tenants) drift apart, so their sweeps do not all come in the same second.
local spread = tonumber(string.sub(redis.sha1hex(room), 1, 6), 16) % math.max(1, idle_ms / 4)
local next_ms = now + idle_ms - math.floor(spread)
local first = redis.call('ZRANGE', deadlines, 0, 0, 'WITHSCORES')
if first[2] then next_ms = math.min(next_ms, tonumber(first[2])) end
if redis.call('ZCARD', room) > 0 then
  first = redis.call('ZRANGE', slots, 0, 0, 'WITHSCORES')
  if first[2] then next_ms = math.min(next_ms, tonumber(first[2])) end
end
local _, _, cool = live_limit(limits, nil)
if cool and redis.call('ZCARD', room) > 0 then next_ms = math.min(next_ms, cool) end
next_ms = math.max(now, next_ms)
redis.call('HSET', parked, '!due', next_ms)
return {1, out, give_ups, next_ms}
