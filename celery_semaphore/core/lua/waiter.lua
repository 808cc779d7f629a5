-- waiter: one waiter's steps in its key's room, shared by park.lua (a run that finds its
-- key full) and claim.lua (a handed-off run that starts). Not a script of its own.
--
--! uses: room
--
-- Both scripts are sent the same KEYS and the same first ARGV:
-- KEYS[1..9]  slots, holders, limits, room, parked, deadlines, blocked, wake, claims (see
--             room.lua)
-- ARGV[1]  limit     the key's limit (integer >= 1); a live limit, when set, wins. The room
--                    hands slots out by the limit its callers give now (one computed per run
--                    may change): every park and claim brings its "!limit" up to date
-- ARGV[2]  lease_ms  lease of the slot taken (integer >= 1)
-- ARGV[3]  token     unique per acquisition: the holder's member, its record in itself
--                    ("<token>|<acquired_at_ms>|<metadata JSON>", process.py)
-- ARGV[4]  weight    how many units of the limit the waiter takes (integer >= 1)
-- ARGV[5]  waiter    the waiter's id (a task id); never starts with "~" or "!"
-- ARGV[7]  room      the room's settings, a JSON object: "claim_ms", how long a hand-off's
--                    reservation waits for its run; "ttl_ms", how long the room outlives its
--                    last touch (recorded as its "!ttl", which room_keep renews); "grace_ms",
--                    how long a reservation is kept for its run alone before a waiter that
--                    is here now may take it (0: for ever)

-- The call's facts (`delivery`: the id of the message the run came in, "" for none).
local function waiter_of(delivery)
  local settings = cjson.decode(ARGV[7])
  local w = {
    slots = KEYS[1], holders = KEYS[2], limits = KEYS[3], room = KEYS[4], parked = KEYS[5],
    deadlines = KEYS[6], claims = KEYS[9], given = tonumber(ARGV[1]),
    lease_ms = tonumber(ARGV[2]), token = ARGV[3], weight = tonumber(ARGV[4]) or 1,
    waiter = ARGV[5], delivery = delivery, claim_ms = settings.claim_ms,
    ttl_ms = settings.ttl_ms, grace_ms = settings.grace_ms, now = now_ms(),
  }
  w.limit = live_limit(w.limits, w.given)
  room_prune(w.slots, w.holders, w.room, w.parked, w.now)
  if redis.call('HEXISTS', w.parked, '!limit') == 1 then
    redis.call('HSET', w.parked, '!limit', w.given)
  end
  return w
end

-- Take a slot for the waiter in place of `member` (a reservation of `units` units; nil: as
-- many as it has), or of nothing (nil): the waiter leaves the room. Its expiry (epoch ms).
local function waiter_take(w, member, units)
  local waiter = w.waiter
  local waited = member == '~' .. waiter or redis.call('HEXISTS', w.parked, waiter) == 1
  if member then
    units_remove(w.slots, member, units)
    redis.call('HDEL', w.holders, member)
  end
  if waited then
    -- Which message took the waiter's turn ("~": one that asked in person), and the token
    -- its run holds: if the broker delivers that message again while the token is held,
    -- it is a copy (a Redis broker restores a message held past its visibility timeout:
    -- for its ETA, say); after, its run was lost or ended; any other copy is a duplicate;
    -- and no record at all means the store lost it (a restart).
    redis.call('HSET', w.claims, waiter, (w.delivery ~= '' and w.delivery or '~') .. '\n' .. w.token)
    redis.call('PEXPIRE', w.claims, w.ttl_ms)
  end
  redis.call('ZREM', w.room, waiter)
  redis.call('HDEL', w.parked, waiter, '!m:' .. waiter, '!p:' .. waiter, '!h:' .. waiter)
  redis.call('ZREM', w.deadlines, waiter, '~' .. waiter)
  room_keep(w.room, w.parked, w.deadlines)
  local expires_at_ms = w.now + w.lease_ms
  units_add(w.slots, w.token, w.weight, expires_at_ms)
  keep_ttl(w.slots, w.lease_ms, 2 * w.lease_ms)
  return expires_at_ms
end

-- The answer for a waiter whose token holds a slot already (a call sent again) or that has a
-- reservation (its hand-off's): {1, expires_at_ms, now_ms, limit} once it holds the slot;
-- {-2, 0, now_ms, limit, wait_ms} when its reservation is for a start rate's instant still
-- wait_ms away; {0, position, now_ms, 0} when the key was paused since: it is back in the
-- room; nil when neither.
local function waiter_held(w)
  local waiter, now = w.waiter, w.now
  local mine = redis.call('ZSCORE', w.slots, w.token)
  if mine then return {1, tonumber(mine), now, w.limit} end
  if not redis.call('ZSCORE', w.slots, '~' .. waiter) then return nil end
  if w.limit == 0 then
    -- Paused or cooling down since its hand-off (its message was on its way behind a
    -- backlog, or held for a start rate's instant): nothing new starts, this run neither. It gives its reservation
    -- back and waits at its place; the resume hands it out again.
    local entry = redis.call('HGET', w.parked, waiter)
    units_remove(w.slots, '~' .. waiter, entry and weight_of(entry))
    redis.call('HDEL', w.holders, '~' .. waiter)
    redis.call('ZREM', w.deadlines, '~' .. waiter)
    room_requeue(w.room, w.parked, place_of(w.parked, waiter) or now, waiter)
    local reply = {0, redis.call('ZRANK', w.room, waiter), now, 0}
    room_hand_off(w.slots, w.holders, w.room, w.parked, w.deadlines, 0, 1, now, reply)
    return reply
  end
  -- A run that came early for its instant (its worker's clock ahead of this server's) waits.
  local record = redis.call('HGET', w.holders, '~' .. waiter) or ''
  local start = tonumber(string.match(record, '"start":(%d+)'))
  if start and start > now then return {-2, 0, now, w.limit, start - now} end
  -- One that comes later than its slack (its worker was busy) would start right beside the
  -- run given the next instant: it takes its units again, at the first instant free now,
  -- and the instant it missed stays spent (the bound holds by the bodies' clocks too).
  local rates = start and room_rates(w.slots, w.parked, now)
  local entry = rates and redis.call('HGET', w.parked, waiter)
  local late = entry and rate_units_of(entry)
  if entry and now - start > rates_slack(rates, late) then
    start = rates_start(rates, late, now)
    rates_take(w.limits, rates, late, start, now)
    redis.call('HSET', w.holders, '~' .. waiter,
      (string.gsub(record, '"start":%d+', '"start":' .. start, 1)))
    if start > now then
      room_reserve(w.slots, w.deadlines, w.parked, waiter, weight_of(entry), start + w.claim_ms)
      return {-2, 0, now, w.limit, start - now}
    end
  end
  local claimed = {1, waiter_take(w, '~' .. waiter, nil), now, w.limit}
  -- The last run of a drained room: the room goes now, not at its next sweep.
  room_close_if_empty(w.room, w.parked, w.deadlines)
  return claimed
end

-- Serve the room, the waiter now standing in it: free slots go to the oldest waiters (this
-- one among them, maybe), and past the grace this waiter may take a reservation whose run
-- has not come. The reply: {1, expires_at_ms, now_ms, limit, hand-offs...} when it holds a
-- slot, else {0, position, now_ms, limit, hand-offs...} (position 0 is next served);
-- hand-offs are {waiter, payload} pairs (room_hand_off's) for the caller to publish.
local function waiter_serve(w)
  local waiter, now, limit = w.waiter, w.now, w.limit
  local out, others = {}, {}
  room_hand_off(w.slots, w.holders, w.room, w.parked, w.deadlines, limit, w.claim_ms, now, out)
  local reply = {0, 0, now, limit}
  for i = 1, #out, 2 do
    if out[i] == waiter then
      reply = {1, waiter_take(w, '~' .. waiter, nil), now, limit}
    else
      others[#others + 1] = out[i]
      others[#others + 1] = out[i + 1]
    end
  end
  if reply[1] == 0 and w.grace_ms > 0 and not redis.call('ZSCORE', w.slots, '~' .. waiter) then
    -- A reservation not claimed within grace_ms: its run's message is still on its way
    -- (behind a backlog in the broker queue, say) while this run is here now. This run takes
    -- the slot rather than leave it idle; the passed-over waiter keeps its place at the head
    -- of the room, and its message, when it comes, finds it parked and waits for the next
    -- hand-off. Never a reservation of a waiter that needs several keys: it holds it while
    -- it waits for its other keys (no message is on its way), and taking it would undo what
    -- it gathered. Under the room's start rates this run takes its own units now (the
    -- passed-over one's went with its instant), or nothing: every start stands on a unit of
    -- its own at its own instant. (A waiter this very call reserved a later instant for is
    -- not here for a slot now.)
    local stale = redis.call('ZRANGEBYSCORE', w.slots, '-inf', now + w.claim_ms - w.grace_ms)
    local rates = #stale > 0 and room_rates(w.slots, w.parked, now)
    local entry = rates and redis.call('HGET', w.parked, waiter)
    local units = entry and rate_units_of(entry)
    for _, member in ipairs(stale) do
      if string.sub(member, 1, 1) == '~' and not string.find(member, '#', 1, true)
          and redis.call('HEXISTS', w.parked, '!m:' .. string.sub(member, 2)) == 0 then
        local passed = string.sub(member, 2)
        local passed_entry = redis.call('HGET', w.parked, passed)
        local held = passed_entry and weight_of(passed_entry) or 1
        -- Only a reservation that frees room enough for this waiter's weight.
        if redis.call('ZCARD', w.slots) - held + w.weight <= limit
            and (not rates or rates_start(rates, units, now) <= now) then
          if rates then rates_take(w.limits, rates, units, now, now) end
          room_requeue(w.room, w.parked, place_of(w.parked, passed) or now, passed)
          reply = {1, waiter_take(w, member, held), now, limit}
          break
        end
      end
    end
  end
  -- A waiter handed a start in the future has left the line: it is next.
  if reply[1] == 0 then reply[2] = redis.call('ZRANK', w.room, waiter) or 0 end
  for _, value in ipairs(others) do reply[#reply + 1] = value end
  room_keep(w.room, w.parked, w.deadlines, w.ttl_ms)
  return reply
end
