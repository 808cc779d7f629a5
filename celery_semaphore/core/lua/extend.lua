-- extend: push one holder's lease expiry forward, if the slot is still its own.
--
-- KEYS[1]  slots    sorted set (see acquire.lua)
-- KEYS[2]  holders  hash (see acquire.lua)
-- ARGV[1]  token      the holder's token
-- ARGV[2]  lease_ms   new lease, counted from now (integer >= 1)
--
-- Returns {1, expires_at_ms} when the slot was ours and is extended, or
--         {0, now_ms}        when it is gone.
--
-- Presence is not ownership: a member whose expiry has passed stays in the set until some
-- acquire prunes it, yet from the moment it lapsed every acquire has counted its slot as
-- free. Reviving it would put the semaphore over its limit, so the score must still be in
-- the future; a lapsed member is removed here, never renewed.
local slots = KEYS[1]
local holders = KEYS[2]
local token = ARGV[1]
local lease_ms = tonumber(ARGV[2])

if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local score = redis.call('ZSCORE', slots, token)
if not score or tonumber(score) <= now_ms then
  if score then
    redis.call('ZREM', slots, token)
    redis.call('HDEL', holders, token)
  end
  return {0, now_ms}
end

local expires_at_ms = now_ms + lease_ms
redis.call('ZADD', slots, 'XX', expires_at_ms, token)
if redis.call('PTTL', slots) < lease_ms then
  redis.call('PEXPIRE', slots, lease_ms)
  redis.call('PEXPIRE', holders, lease_ms)
end
return {1, expires_at_ms}
