-- held: whether each of some holders' slots is still its own (read only).
--
-- KEYS[i]  slots  sorted set of the i-th holder's semaphore (see acquire.lua)
-- ARGV[i]  token  the i-th holder's token
--
-- Returns {held_1, held_2, ...}: 1 when the token is a member whose expiry is later than the
-- server's clock, else 0 (never taken, released, force-released, or lapsed).
--
-- Presence is not ownership: a lapsed member stays in the set until some acquire or extend
-- prunes it, yet every acquire has counted its slot as free since it lapsed, so the score is
-- compared with the server's clock here, as extend.lua compares it. Nothing is written: an
-- operator may ask as often as it likes without moving a lease.
--! uses: clock
local now_ms = now_ms()

local reply = {}
for i = 1, #KEYS do
  local score = redis.call('ZSCORE', KEYS[i], ARGV[i])
  reply[i] = (score and tonumber(score) > now_ms) and 1 or 0
end
return reply
