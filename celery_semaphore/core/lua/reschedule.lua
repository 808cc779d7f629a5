-- reschedule: score the waiting rooms a caller just swept with when each next needs a sweep,
-- without undoing a mark that brought one on meanwhile.
--
-- KEYS[1]  index     sorted set: semaphore key -> when its room is next due for a sweep
--                    (epoch ms by the server's clock; see due_rooms.lua)
-- ARGV     key_1, taken_1, next_1, key_2, ...: each room, its score when the caller took it
--          to sweep (due_rooms.lua pushed it there, or the caller read it before its sweep),
--          and when its sweep says it is next due (epoch ms)
--
-- Returns how many rooms were scored. A room left the index meanwhile stays out. A room
-- still at the score it was taken with is scored `next`; any other score was written since
-- (a mark of a reservation made after the sweep, a park with a deadline: see room.lua's
-- room_bring_on, or another caller that took the room after an interval), and is lowered
-- to `next` at most, never raised: a sweep that lost that race is never later than either.
local index = KEYS[1]
local scored = 0
for i = 1, #ARGV, 3 do
  local key, taken, next_ms = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local score = tonumber(redis.call('ZSCORE', index, key))
  if score and (score == taken or next_ms < score) then
    redis.call('ZADD', index, 'XX', next_ms, key)
    scored = scored + 1
  end
end
return scored
