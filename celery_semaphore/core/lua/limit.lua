-- limit: the limit that applies to a key now, read from its limits hash. Not a script of
-- its own.
--
--! uses: clock
--
-- The limits hash (KEYS[3] of the scripts, "<slots>:limits") holds what the store decides
-- over the callers' limit: an operator's live limit and pause (set_limit.lua), and what the
-- provider's answers decided (adapt.lua): a back-off's cool-down, "cool:until" (epoch ms),
-- and an adaptive limit's current value, "a:limit" (a float: it grows by fractions).

-- The limit that applies: 0 while the key is paused or cooling down after a back-off, else
-- an operator's live limit, else the adaptive limit, else `given` (a number or nil). Also
-- answers whether the store decided it (not `given`), and the cool-down's end (epoch ms)
-- while one lasts.
local function live_limit(limits, given)
  local set = redis.call('HMGET', limits, 'limit', 'paused_at', 'a:limit', 'cool:until')
  if set[2] then return 0, true end
  local cool = tonumber(set[4])
  if cool and cool > now_ms() then return 0, true, cool end
  if set[1] then return tonumber(set[1]), true end
  if set[3] then return math.floor(tonumber(set[3])), true end
  return given, false
end
