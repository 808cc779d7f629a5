-- extend: push holders' lease expiries forward, each only if its slot is still its own. One
-- call renews every slot a process holds (in one cluster hash slot), whatever its semaphore.
--
-- KEYS[2i-1]  slots    sorted set of the i-th holder's semaphore (see acquire.lua)
-- KEYS[2i]    holders  hash of the same semaphore (see acquire.lua)
-- ARGV[3i-2]  token      the i-th holder's token
-- ARGV[3i-1]  lease_ms   its new lease, counted from now (integer >= 1)
-- ARGV[3i]    weight     its weight: the members "<token>#2".."<token>#<weight>" go with it
--
-- Returns {now_ms, expires_at_ms_1, expires_at_ms_2, ...}: each holder's new expiry, or 0
-- when its slot is gone.
--
-- Presence is not ownership: a member whose expiry has passed stays in the set until some
-- acquire prunes it, yet from the moment it lapsed every acquire has counted its slot as
-- free. Reviving it would put the semaphore over its limit, so the score must still be in
-- the future; a lapsed member is removed here, never renewed.
--! uses: clock
local now_ms = now_ms()

local reply = {now_ms}
for i = 1, #KEYS / 2 do
  local slots, holders = KEYS[2 * i - 1], KEYS[2 * i]
  local token, lease_ms = ARGV[3 * i - 2], tonumber(ARGV[3 * i - 1])
  local weight = tonumber(ARGV[3 * i]) or 1
  local score = redis.call('ZSCORE', slots, token)
  if not score or tonumber(score) <= now_ms then
    if score then
      redis.call('ZREM', slots, token)
      for w = 2, weight do redis.call('ZREM', slots, token .. '#' .. w) end
      redis.call('HDEL', holders, token)
    end
    reply[#reply + 1] = 0
  else
    local expires_at_ms = now_ms + lease_ms
    redis.call('ZADD', slots, 'XX', expires_at_ms, token)
    for w = 2, weight do redis.call('ZADD', slots, 'XX', expires_at_ms, token .. '#' .. w) end
    -- With the same headroom as acquire.lua, so that renewals rarely write the TTL; a
    -- holder whose record is in the holders hash, not in its member, keeps the hash alive.
    keep_ttl(slots, lease_ms, 2 * lease_ms)
    if not string.find(token, '|', 1, true) then keep_ttl(holders, lease_ms, 2 * lease_ms) end
    reply[#reply + 1] = expires_at_ms
  end
end
return reply
