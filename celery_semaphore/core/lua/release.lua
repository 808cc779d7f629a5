-- release: give one slot back.
--
-- KEYS[1]  slots    sorted set (see acquire.lua)
-- KEYS[2]  holders  hash (see acquire.lua)
-- ARGV[1]  token    the holder's token
--
-- Returns 1 when the slot was still ours up to this moment (present, expiry in the future),
--         0 when it had lapsed or been taken away (the bound did not hold for the whole body).
-- The holder is removed either way, and an empty semaphore is deleted.
local slots = KEYS[1]
local holders = KEYS[2]
local token = ARGV[1]

if redis.replicate_commands then pcall(redis.replicate_commands) end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local score = redis.call('ZSCORE', slots, token)
local owned = 0
if score then
  if tonumber(score) > now_ms then owned = 1 end
  redis.call('ZREM', slots, token)
  redis.call('HDEL', holders, token)
  if redis.call('ZCARD', slots) == 0 then redis.call('DEL', slots, holders) end
end
return owned
