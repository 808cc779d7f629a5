-- holders: list the live holders of one semaphore (read only).
--
-- KEYS[1]  slots    sorted set (see acquire.lua)
-- KEYS[2]  holders  hash (see acquire.lua)
--
-- Returns {now_ms, token_1, expires_at_ms_1, info_1, token_2, ...} for every holder whose
-- lease has not expired, soonest expiry first; info is "<acquired_at_ms>|<metadata JSON>"
-- (or "" if missing). Server time is returned so a caller can show "expires in" without
-- trusting its own clock.
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local reply = {now_ms}
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms, '+inf', 'WITHSCORES')
for i = 1, #live, 2 do
  -- "<token>#i" members are the further units of a weighted holder, not holders.
  if not string.find(live[i], '#', 1, true) then
    reply[#reply + 1] = live[i]
    reply[#reply + 1] = tonumber(live[i + 1])
    reply[#reply + 1] = redis.call('HGET', KEYS[2], live[i]) or ''
  end
end
return reply
