-- claim: a handed-off run starts: it takes the slot its hand-off reserved for it. A run whose
-- reservation lapsed (it came after its claim lease) finds itself back in the room at its old
-- place, and is served in turn like any waiter.
--
-- KEYS and ARGV[1..5], ARGV[7]: see waiter.lua
-- ARGV[6]  delivery  an id of the message this run came in ("" if none), recorded with the
--                    claim, so that a delivery of the same message again is told from a copy
--
-- Returns {1, expires_at_ms, now_ms, limit, hand-offs...}  the run holds its slot
--         {0, position, now_ms, limit, hand-offs...}      it waits in the room again
--                                                        (position 0 is next served)
--         {-2, again, now_ms, limit, wait_ms}             no slot for it now: with wait_ms
--                                                        > 0, its reservation starts then
--                                                        (a start rate's instant, which it
--                                                        came early for: claim again then);
--                                                        else nothing is reserved or parked
--                                                        for it, and again is 2 when no
--                                                        claim of it is on record, 1 when
--                                                        this very delivery claimed a slot
--                                                        before (the broker delivered it
--                                                        again: its run was lost, or
--                                                        ended), 3 when it did and that
--                                                        slot is still held (then the
--                                                        reply ends with its token: see
--                                                        WaitingRoom.outlives), 0 for
--                                                        another copy
-- limit is the one that applied; hand-offs as park.lua's.
--! uses: waiter
local w = waiter_of(ARGV[6])
local held = waiter_held(w)
if held then return held end
local at = place_of(w.parked, w.waiter)
if not at then
  local claimed = redis.call('HGET', w.claims, w.waiter)
  local again = 2  -- no claim of the waiter on record (the store may have lost it)
  if claimed then
    local by, token = string.match(claimed, '^([^\n]*)\n?(.*)$')
    again = (w.delivery ~= '' and by == w.delivery) and 1 or 0
    -- The same message again while the run it started holds its slot: a copy, not a
    -- lost run.
    if again == 1 and (tonumber(redis.call('ZSCORE', w.slots, token)) or 0) > w.now then
      return {-2, 3, w.now, w.limit, 0, token}
    end
  end
  return {-2, again, w.now, w.limit, 0}
end
-- Parked with no reservation: it stands in the room at its place again (a plain acquire
-- may have pruned its lapsed reservation without putting it back), and the room is served.
redis.call('HSET', w.parked, '!limit', w.given, '!ttl', w.ttl_ms)
redis.call('ZADD', w.room, at, w.waiter)
return waiter_serve(w)
