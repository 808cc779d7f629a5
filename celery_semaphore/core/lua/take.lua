-- take: the first try of a run whose key's room its process has not seen: take a free slot
-- of a key that has no waiting room, or do nothing (the caller then parks the run with its
-- message, park.lua, which it makes only now).
--
-- KEYS[1..5]  slots, holders, limits, room, parked (see room.lua)
-- ARGV[1]  limit     the key's limit (integer >= 1); a live limit, when set, wins
-- ARGV[2]  lease_ms  lease of the slot taken (integer >= 1)
-- ARGV[3]  token     the holder's member, its record in itself (see acquire.lua)
-- ARGV[4]  weight    how many units of the limit the run takes (integer >= 1)
--
-- Returns now_ms or {2, expires_at_ms, now_ms, limit}: a slot was taken (free.lua); or 0:
-- the key has a room, or too few units are free, or the token is there already: nothing
-- was done. Never under start rates: a run of a key with rates goes to park.lua at once.
--! uses: free
if redis.call('EXISTS', KEYS[4], KEYS[5]) > 0 then return 0 end
local weight = tonumber(ARGV[4]) or 1
return free_take(KEYS[1], KEYS[3], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], weight)
  or 0
