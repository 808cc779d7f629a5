"""The waiting room, Celery side: everything between a run that finds its key full and the
run that starts in its place, in the order a run meets it.

- :mod:`.parking`: a run that finds every slot held parks in the key's room with its message
  and ends (``Ignore``); a run past its wait budget leaves the room and fails.
- :mod:`.handoffs`: a release that reserves a freed slot for the oldest parked run publishes
  that run's message; the run claims the slot when it starts.
- :mod:`.queues`: the hand-off queue each hand-off goes to, beside its run's own queue, so it
  is not fetched behind the backlog.
- :mod:`.sweeps`: the safety net the workers share out (each room when something in it falls
  due, by the whole fleet), so a room drains even when the process that should have
  published a hand-off died; :mod:`.revoked`: the revoked runs the workers take out.

The marks a hand-off's message carries are :mod:`celery_semaphore.integration.shedding`'s,
beside the shed headers a parked run keeps its first arrival by.

The room itself (park, claim, cancel, sweep, and the Lua that does them) is the core's:
:mod:`celery_semaphore.core.room`.
"""
