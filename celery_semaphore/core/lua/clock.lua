-- clock: the lines every script opens with (scripts.py puts this file above each one).
-- Not a script of its own.
--
-- Scripts that write after TIME need effect replication on Redis < 7 (a no-op later), and
-- every time a script reads is the server's: callers' clocks may be off, so no instant
-- that decides a lease, a deadline or a start ever comes from ARGV.
if redis.replicate_commands then pcall(redis.replicate_commands) end

-- The server's time, epoch ms.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Set `key`'s TTL to `to_ms` when less than `below_ms` is left (or it has none): callers
-- pass twice what they need as `to_ms`, so a busy key is written about once per `below_ms`
-- rather than on every call, which PTTL's millisecond steps would otherwise ask for.
-- (PEXPIRE ... GT would save the PTTL, but needs Redis 7, and would still write each time.)
local function keep_ttl(key, below_ms, to_ms)
  if redis.call('PTTL', key) < below_ms then redis.call('PEXPIRE', key, to_ms) end
end
