-- free: the slot a run takes on a key that has no waiting room, as a plain acquire would,
-- for take.lua and park.lua. Not a script of its own.
--
--! uses: clock limit

-- Take `weight` units of `slots` for `token` (its member, carrying its record) if they are
-- free under `given`, or under the limit the limits hash decides (limit.lua), and
-- if `rates` (rates.lua's, read by a caller that carries that file; nil: none) allow a start
-- now with `units`. The reply to send: now_ms for a new slot under `given` (it expires at
-- now_ms + lease_ms), {2, expires_at_ms, now_ms, limit} under the hash's; or nil when
-- nothing was taken (no room enough, a rate's instant still to come, or the token is a
-- member already).
local function free_take(slots, limits, given, lease_ms, token, weight, rates, units)
  local limit, stored = live_limit(limits, given)
  local now = now_ms()
  if rates and rates_start(rates, units, now) > now then return nil end
  if redis.call('ZCARD', slots) + weight > limit
      or redis.call('ZADD', slots, 'NX', now + lease_ms, token) == 0 then
    return nil
  end
  if rates then rates_take(limits, rates, units, now, now) end
  for i = 2, weight do redis.call('ZADD', slots, now + lease_ms, token .. '#' .. i) end
  keep_ttl(slots, lease_ms, 2 * lease_ms)  -- as acquire.lua: a PEXPIRE about once a lease
  if stored then return {2, now + lease_ms, now, limit} end
  return now
end
