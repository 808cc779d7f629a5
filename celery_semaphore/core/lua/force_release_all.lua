-- force_release_all: free every slot of one semaphore (an operator's recovery tool).
--
-- KEYS[1]  slots    sorted set (see acquire.lua)
-- KEYS[2]  holders  hash (see acquire.lua)
--
-- Returns how many LIVE holders were displaced (lapsed ones are not counted). Each
-- displaced holder learns of it at its next extend or release, which will answer "gone".
--! uses: clock
local now_ms = now_ms()
local live = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms, '+inf')) do
  if not string.find(member, '#%d+$') then live = live + 1 end
end
redis.call('DEL', KEYS[1], KEYS[2])
return live
