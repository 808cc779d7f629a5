-- block: register a caller that is about to block on the wake list waiting for a slot
-- (Semaphore.acquire with wait=...), so that a release in the meantime wakes it.
--
-- KEYS[1]  blocked  sorted set: token -> when the caller stops blocking (ms; see room.lua)
-- ARGV[1]  token    the caller's acquisition token
-- ARGV[2]  for_ms   how long it blocks at most (integer >= 1)
--
-- Returns the server's time, ms. The caller asks for a slot again right after this, so a
-- slot freed between its last attempt and its block is never missed.
--! uses: clock
local now = now_ms()
local for_ms = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + for_ms, ARGV[1])
keep_ttl(KEYS[1], for_ms, for_ms)
return now
