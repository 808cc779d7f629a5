-- due_rooms: hand the caller the waiting rooms due for a sweep, and make each of them due
-- again one interval later, so that the workers of a fleet share the rooms out between
-- them instead of each sweeping every room.
--
-- KEYS[1]  index     sorted set: semaphore key -> when its room is next due for a sweep,
--                    epoch ms by the server's clock (a park adds a new room with score 0:
--                    due at once; see room_index.py)
-- ARGV[1]  interval_ms  how far ahead a room handed out is pushed (integer >= 1)
-- ARGV[2]  count        the most rooms to hand out (integer >= 1)
-- ARGV[3]  ttl_ms       the index's TTL is raised to this when less than half is left
--                       (integer >= 1): the sweeps keep it alive as they keep the rooms
--
-- Returns {now_ms, next_ms, key_1, key_2, ...}: the server's time; the lowest score left in
-- the index once those handed out are pushed ahead (-1: the index is empty), which is at
-- most now_ms when more rooms are due than `count`; and up to `count` keys whose score is
-- at most now_ms, the most overdue first. A caller that dies before it sweeps them leaves
-- them due again one interval later, for any other caller to take.
--! uses: clock
local index = KEYS[1]
local interval_ms, count, ttl_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])

local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, count)
local reply = {now, -1}
local args = {}
for i, key in ipairs(due) do
  reply[#reply + 1] = key
  args[#args + 1] = now + interval_ms
  args[#args + 1] = key
  -- One ZADD per 200 keys: each call's arguments stay far below Lua's stack limit.
  if #args == 400 or i == #due then
    redis.call('ZADD', index, 'XX', unpack(args))
    args = {}
  end
end
local first = redis.call('ZRANGE', index, 0, 0, 'WITHSCORES')
if first[2] then reply[2] = tonumber(first[2]) end
if #due > 0 then
  local ttl = redis.call('PTTL', index)
  if ttl ~= -2 and ttl < ttl_ms / 2 then redis.call('PEXPIRE', index, ttl_ms) end
end
return reply
