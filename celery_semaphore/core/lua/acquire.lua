-- acquire: take one slot of a leased counting semaphore, if one is free.
--
-- KEYS[1]  slots    sorted set: member = holder token, score = lease expiry (ms, Redis TIME)
-- KEYS[2]  holders  hash: token -> "<acquired_at_ms>|<metadata JSON>" of holders that other
--                   scripts took (several keys, hand-offs); this one only deletes from it
-- KEYS[3]  limits   hash: what the store decides over ARGV[1] (limit.lua): an operator's
--                   live limit or pause (the limit is then 0), an adaptive limit, or a
--                   back-off's cool-down (no start before it ends)
-- KEYS[4]  room     sorted set of the runs waiting in the key's room (room.lua): while any
--                   waits, a free unit is theirs (the room hands it out in order), so this
--                   call is refused as on a full key, and a stream of light callers cannot
--                   starve a heavy run at the room's head
-- ARGV[1]  limit      how many live holders the semaphore admits (integer >= 1), unless the
--                     limits hash decides another, which wins
-- ARGV[2]  lease_ms   how long the new slot lives without an extend (integer >= 1)
-- ARGV[3]  token      the holder's member, unique per acquisition, its record in itself:
--                     "<token>|<acquired_at_ms>|<metadata JSON>" (process.py), so that a
--                     slot taken and given back writes one key, not two
-- ARGV[4]  weight     how many units of the limit the holder takes (integer >= 1): its
--                     member, then "<member>#2".."<member>#<weight>" are members of the set
-- ARGV[5]  rates      how many start rates the key has (absent: none), then for each from
--                     ARGV[6]: name, interval_ms, burst, and the units this call takes
--                     (see rates.lua); a slot is taken only if every rate allows it now.
--                     Only the acquire_rated script, which has rates.lua above this one,
--                     is sent rates (scripts.py)
--
-- Returns now_ms when the token took a new slot under ARGV[1] (it expires at now_ms +
--         lease_ms), or
--         {1, expires_at_ms, now_ms, limit} when it holds a slot otherwise (the limits
--         hash's limit applied, or the token already held it), or
--         {0, units_held, now_ms, first_expiry_ms, limit} when too few units are free;
--         first_expiry_ms is when the soonest lease lapses (so a caller that waits for a
--         slot knows when one frees itself), or 0 when no unit is held (a weight above a
--         lowered live limit); limit is the one that applied; or
--         {0, units_held, now_ms, 0, limit, start_ms} when a rate or a back-off's
--         cool-down allows no start before start_ms (epoch ms), whether or not a slot is
--         free (limit 0: the cool-down).
--
-- The common answer is a bare integer because a client reads it several times faster
-- than an array. Expired holders are pruned here when the key is full, so a crashed
-- holder's slot comes back on the next acquire with no sweeper. A token that already holds
-- a live slot is answered with that slot and nothing more is taken, so a client that
-- resends the call after a lost reply cannot leak a slot. Every reply element is an
-- integer (RESP2/RESP3 safe).
--! uses: clock limit
local slots = KEYS[1]
local holders = KEYS[2]
local limit, stored, cool = live_limit(KEYS[3], tonumber(ARGV[1]))
local lease_ms = tonumber(ARGV[2])
local token = ARGV[3]
local weight = tonumber(ARGV[4]) or 1

local now_ms = now_ms()
local expires_at_ms = now_ms + lease_ms

local live = redis.call('ZCARD', slots)
if cool then  -- a back-off's cool-down: no start before it ends, as a rate's instant
  local mine = tonumber(redis.call('ZSCORE', slots, token))
  if mine and mine > now_ms then return {1, mine, now_ms, limit} end
  return {0, live, now_ms, 0, 0, cool}
end
local nrates, rates, units = tonumber(ARGV[5]) or 0, nil, nil
if nrates > 0 then
  rates, units = rates_read(KEYS[3], ARGV, 6, nrates, 4, now_ms), {}
  for i = 0, nrates - 1 do units[ARGV[6 + 4 * i]] = tonumber(ARGV[9 + 4 * i]) end
  local mine = tonumber(redis.call('ZSCORE', slots, token))
  if mine and mine > now_ms then return {1, mine, now_ms, limit} end
  local start = rates_start(rates, units, now_ms)
  if start > now_ms then return {0, live, now_ms, 0, limit, start} end
end
-- A plain holder on a key with a free slot is added in one step; NX leaves a token that is
-- already a member (a resent call) to the checks below.
local queued = redis.call('EXISTS', KEYS[4]) == 1
if weight > 1 or live >= limit or queued
    or redis.call('ZADD', slots, 'NX', expires_at_ms, token) == 0 then
  local mine = tonumber(redis.call('ZSCORE', slots, token))
  if mine and mine > now_ms then
    return {1, mine, now_ms, limit}
  end
  if queued then
    local first = redis.call('ZRANGE', slots, 0, 0, 'WITHSCORES')
    return {0, live, now_ms, tonumber(first[2]) or 0, limit}
  end
  -- Lapsed members are pruned only when they stand in the way: a key with a free slot is
  -- admitted without the scan.
  if live + weight > limit then
    local expired = redis.call('ZRANGEBYSCORE', slots, '-inf', now_ms)
    if #expired > 0 then
      redis.call('ZREMRANGEBYSCORE', slots, '-inf', now_ms)
      redis.call('HDEL', holders, unpack(expired))
      live = live - #expired
    end
    if live + weight > limit then
      local first = redis.call('ZRANGE', slots, 0, 0, 'WITHSCORES')
      return {0, live, now_ms, tonumber(first[2]) or 0, limit}
    end
  end
  redis.call('ZADD', slots, expires_at_ms, token)
  for i = 2, weight do redis.call('ZADD', slots, expires_at_ms, token .. '#' .. i) end
end
if rates then rates_take(KEYS[3], rates, units, now_ms, now_ms) end
-- The set outlives every live lease, so an abandoned semaphore disappears by itself (within
-- two leases); the holders hash is kept alive by those whose records it holds (extend.lua).
-- A key nobody held (live is 0) was just made by the ZADD and has no TTL yet: no need to
-- ask (an uncontended key is made anew by each acquire, its last release deleting it).
if live == 0 then
  redis.call('PEXPIRE', slots, 2 * lease_ms)
else
  keep_ttl(slots, lease_ms, 2 * lease_ms)
end
if stored then return {1, expires_at_ms, now_ms, limit} end
return now_ms
