-- count: how many units of one semaphore live holders use now (read only): one per holder,
-- or its weight for a weighted one.
--
-- KEYS[1]  slots    sorted set (see acquire.lua)
--
-- Returns the number of members whose lease expiry is later than the server's clock;
-- lapsed members that no acquire has pruned yet are not counted.
--! uses: clock
local now_ms = now_ms()
return redis.call('ZCOUNT', KEYS[1], '(' .. now_ms, '+inf')
