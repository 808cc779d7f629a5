-- release: give one slot back, and hand it to the oldest parked waiter in the same step.
--
-- KEYS[1..8]  slots, holders, limits, room, parked, deadlines, blocked, wake (see room.lua)
-- ARGV[1]  token     the holder's token
-- ARGV[2]  claim_ms  how long a hand-off's reservation waits for its run (integer >= 1), or
--                    0 when the caller cannot publish hand-offs: the slot is left free, and
--                    the next sweep hands it out (the reply then asks the caller, by the
--                    pair {"~sweep", <the room index's key>}, to make that sweep due now)
-- ARGV[3]  weight    the holder's weight when above 1 (absent: 1), or "" when the caller
--                    does not know it (an operator's force release): then every
--                    "<token>#i" member goes
-- ARGV[4]  adaptive  with a verdict on how the run went, the key's adaptive limit as
--                    "<initial> <min> <max>" ("": not adaptive); absent: no verdict
-- ARGV[5]  back-off  absent: the run ended well (an adaptive limit may grow); else the
--                    provider refused it: "<hint_ms> <cap_ms> <started_ms>", the cool-down
--                    it asked for (-1: none), the longest one, and when the run took its
--                    slot (epoch ms); see adapt.lua
-- ARGV[6]  by        who backed off (text shown by the views)
--
-- Returns owned, or {owned, hand-offs...} when the release handed slots off; after a
-- back-off always {owned, cool_until_ms, hand-offs...}. owned is 1 when
-- the slot was still ours up to this moment (present, expiry in the future), 0 when it had
-- lapsed or been taken away (the bound did not hold for the whole body); hand-offs are
-- {waiter, payload} pairs the caller publishes. A plain holder of a key with no room and
-- nobody blocked is answered 1 when it was present at all: its own lease deadline, which
-- its client keeps on the safe side of the store's (slot.py), tells it whether it had
-- lapsed, so this path needs neither the clock nor the expiry.
-- The holder is removed either way, and a semaphore with no holder and no room is deleted.
-- The limit comes from the room (a live limit, else "!limit", written by park.lua): no room,
-- no hand-off.
-- A freed slot that no parked waiter took wakes one caller blocked on the wake list.
local slots, holders, token = KEYS[1], KEYS[2], ARGV[1]

-- With no room (no parked hash) and nobody blocked, a freed slot has nobody to go to: a
-- plain holder only leaves, and Redis deletes each key as its last member goes. This runs
-- before the room's steps are even defined, and reads no clock, so it replicates as it
-- stands on any Redis.
if ARGV[3] == nil and redis.call('EXISTS', KEYS[5], KEYS[7]) == 0 then
  if redis.call('ZREM', slots, token) == 0 then return 0 end
  -- A member that carries its record (acquire.lua) has no hash field to delete.
  if not string.find(token, '|', 1, true) then redis.call('HDEL', holders, token) end
  return 1
end
--! uses: room adapt
local limits, room, parked = KEYS[3], KEYS[4], KEYS[5]
local blocked, wake = KEYS[7], KEYS[8]
local claim_ms, weight = tonumber(ARGV[2]), tonumber(ARGV[3] or 1)
local now = now_ms()

local score = redis.call('ZSCORE', slots, token)
local owned = 0
local reply = {}
if ARGV[5] then
  local hint, cap, started = string.match(ARGV[5], '^(%S+) (%S+) (%S+)$')
  reply[1] = adapt_back_off(limits, ARGV[4], tonumber(hint), tonumber(cap), tonumber(started),
    ARGV[6], now)
elseif ARGV[4] and ARGV[4] ~= '' and score then
  local waiting = redis.call('EXISTS', room, blocked) > 0
  adapt_grow(limits, ARGV[4], redis.call('ZCARD', slots), waiting, now)
end
if score then
  if tonumber(score) > now then owned = 1 end
  units_remove(slots, token, weight)
  redis.call('HDEL', holders, token)
  -- A reservation taken away (an operator's force release): the next sweep puts its waiter
  -- back into the room.
  if string.sub(token, 1, 1) == '~' and redis.call('ZSCORE', KEYS[6], token) then
    redis.call('ZADD', KEYS[6], now, token)
  end
end
local limit = room_limit(limits, parked)
if limit then room_keep(room, parked, KEYS[6]) end
if limit and claim_ms > 0 then
  room_prune(slots, holders, room, parked, now)
  room_hand_off(slots, holders, room, parked, KEYS[6], limit, claim_ms, now, reply)
elseif not limit and redis.call('ZCARD', slots) == 0 then
  redis.call('DEL', slots, holders)
end
if score and #reply == 0 then room_wake(blocked, wake, now) end
if limit and claim_ms == 0 and redis.call('ZCARD', room) > 0 then
  -- The room's score in the index says when its last sweep saw something fall due; a slot
  -- left free for the next one is due now.
  room_bring_on(slots, parked, 0, reply)
end
if #reply == 0 then return owned end
table.insert(reply, 1, owned)
return reply
