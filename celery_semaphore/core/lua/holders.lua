-- holders: list the live holders of one semaphore (read only).
--
-- KEYS[1]  slots    sorted set (see acquire.lua)
-- KEYS[2]  holders  hash (see acquire.lua)
--
-- Returns {now_ms, token_1, expires_at_ms_1, info_1, token_2, ...} for every holder whose
-- lease has not expired, soonest expiry first; info is "<acquired_at_ms>|<metadata JSON>"
-- (or "" if missing), from the member itself when it carries it ("<token>|<info>", see
-- acquire.lua), else from the holders hash. Server time is returned so a caller can show
-- "expires in" without trusting its own clock.
--! uses: clock
local now_ms = now_ms()

local reply = {now_ms}
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms, '+inf', 'WITHSCORES')
for i = 1, #live, 2 do
  -- "<member>#i" members are the further units of a weighted holder, not holders (a
  -- record's JSON may hold a "#", but never ends in one and digits).
  local member = live[i]
  if not string.find(member, '#%d+$') then
    local token, info = string.match(member, '^([^|]*)|(.*)$')
    reply[#reply + 1] = token or member
    reply[#reply + 1] = tonumber(live[i + 1])
    reply[#reply + 1] = info or redis.call('HGET', KEYS[2], member) or ''
  end
end
return reply
