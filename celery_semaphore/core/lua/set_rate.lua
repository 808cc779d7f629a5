-- set_rate: set (or clear) a key's live start rate of one name, which wins over the rate of
-- that name its callers give (rates.lua reads it) until it is cleared.
--
-- KEYS[1]  limits  the key's limits hash (see room.lua)
-- ARGV[1]  name      the rate's name ("requests", "tokens", ...)
-- ARGV[2]  rate      "<interval_ms> <burst>" as rates.lua reads it, or "" to clear it
-- ARGV[3]  spelling  the rate as the operator gave it ("300/m"), for the views
-- ARGV[4]  by        who makes the change (text shown by the views)
--
-- Returns {previous spelling ("" for none), now_ms}. The hash has no TTL while it holds an
-- operator's setting (rates_keep); the rate's state, its TAT, is kept as it is: a run
-- already handed an instant keeps it, and the next starts follow the new rate.
--! uses: clock rates
local limits, name = KEYS[1], ARGV[1]
local now = now_ms()
local before = redis.call('HGET', limits, 'rate_spec:' .. name)
if ARGV[2] == '' then
  redis.call('HDEL', limits, 'rate:' .. name, 'rate_spec:' .. name, 'rate_by:' .. name,
    'rate_at:' .. name)
else
  redis.call('HSET', limits, 'rate:' .. name, ARGV[2], 'rate_spec:' .. name, ARGV[3],
    'rate_by:' .. name, ARGV[4], 'rate_at:' .. name, now)
end
rates_keep(limits, now)
return {before or '', now}
