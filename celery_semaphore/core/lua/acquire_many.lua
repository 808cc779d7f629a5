-- acquire_many: take a slot of every one of several semaphores, all together or none.
--
-- KEYS[3i-2..3i]  slots, holders, limits of the i-th semaphore (see acquire.lua); on Redis
--                 Cluster all of them share one hash slot
-- ARGV[1]  lease_ms   how long the new slots live without an extend (integer >= 1)
-- ARGV[2]  token      unique per acquisition, the same on every semaphore
-- ARGV[3]  metadata   JSON text describing the holder
-- ARGV[2i+2], ARGV[2i+3]  limit and weight of the i-th semaphore (a live limit, when set,
--                 wins over the limit)
--
-- Returns {1, expires_at_ms, now_ms, limit_1, ..., limit_n} when the token holds a slot of
--         every semaphore, or
--         {0, i, units_held, now_ms, first_expiry_ms, limit} when the i-th one has too few
--         units free (first_expiry_ms 0: it has no holder); then nothing was taken anywhere.
--
-- Like acquire.lua: lapsed holders are pruned only where they stand in the way, and a token
-- that already holds its slots (a resent call) is answered with them.
--! uses: clock limit
local now_ms = now_ms()
local lease_ms, token, metadata = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local count = #KEYS / 3

local limits = {}
for i = 1, count do
  limits[i] = live_limit(KEYS[3 * i], tonumber(ARGV[2 * i + 2]))  -- paused, cooling: 0
end

local mine = tonumber(redis.call('ZSCORE', KEYS[1], token))
if mine and mine > now_ms then
  return {1, mine, now_ms, unpack(limits)}
end

for i = 1, count do
  local slots, holders = KEYS[3 * i - 2], KEYS[3 * i - 1]
  local weight = tonumber(ARGV[2 * i + 3])
  local live = redis.call('ZCARD', slots)
  if live + weight > limits[i] then
    local expired = redis.call('ZRANGEBYSCORE', slots, '-inf', now_ms)
    if #expired > 0 then
      redis.call('ZREMRANGEBYSCORE', slots, '-inf', now_ms)
      redis.call('HDEL', holders, unpack(expired))
      live = live - #expired
    end
    if live + weight > limits[i] then
      local first = redis.call('ZRANGE', slots, 0, 0, 'WITHSCORES')
      return {0, i, live, now_ms, tonumber(first[2]) or 0, limits[i]}
    end
  end
end

local expires_at_ms = now_ms + lease_ms
for i = 1, count do
  local slots, holders = KEYS[3 * i - 2], KEYS[3 * i - 1]
  redis.call('ZADD', slots, expires_at_ms, token)
  for w = 2, tonumber(ARGV[2 * i + 3]) do
    redis.call('ZADD', slots, expires_at_ms, token .. '#' .. w)
  end
  redis.call('HSET', holders, token, now_ms .. '|' .. metadata)
  keep_ttl(slots, lease_ms, 2 * lease_ms)
  keep_ttl(holders, lease_ms, 2 * lease_ms)
end
return {1, expires_at_ms, now_ms, unpack(limits)}
