-- waiting: list the runs parked in one semaphore's waiting room (read only).
--
-- KEYS[1]  room    sorted set: waiter id -> its place, the arrival ms or a fair turn
--                  (see room.lua)
-- KEYS[2]  parked  hash: waiter id -> "<arrival_ms>...|<payload>" (see room.lua)
-- ARGV[1]  last    the index of the last to list, counted from the first served (0: only
--                  the first; -1: to the end)
-- ARGV[2]  first   the index of the first to list (absent: 0), for a page further down
--
-- Returns {now_ms, count, waiter_1, arrival_ms_1, waiter_2, ...}, first served first (with
-- fair turns, not always the oldest first). Server time
-- is returned so a caller can show how long each has waited without trusting its own clock
-- (and, on a cluster, in the one call that reaches the room's node).
--! uses: clock
local now_ms = now_ms()
local reply = {now_ms, redis.call('ZCARD', KEYS[1])}
local first = tonumber(ARGV[2] or 0)
local rows = redis.call('ZRANGE', KEYS[1], first, tonumber(ARGV[1]), 'WITHSCORES')
for i = 1, #rows, 2 do
  local entry = redis.call('HGET', KEYS[2], rows[i])
  reply[#reply + 1] = rows[i]
  reply[#reply + 1] = tonumber(entry and string.match(entry, '^(%d+)') or rows[i + 1])
end
return reply
