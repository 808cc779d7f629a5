"""Revoked runs, looked for in the rooms a worker sweeps.

A worker learns of a revoke (``celery control revoke``) by broadcast, into Celery's
``worker_state.revoked``, which it remembers for hours. A parked run has no message that a
worker could discard, so the sweeps take revoked runs out of the rooms (see
:mod:`.sweeps`). What that costs a sweep of one room grows with the revoked ids it looks
for, never with the room:

- an id the worker learned since its last look is looked up in its host's journal of parked
  runs (see :mod:`.journal`), which names the run's keys: the worker of the host that parked
  the run takes it out of its rooms within an interval, whatever the number of rooms;
- an id the worker learned within the last :data:`FRESH` seconds is looked for in every room
  it sweeps (a run parked by a host with no journal, or whose journal was lost); a still
  room is swept only every quarter TTL, so such a run may stay until its turn, when the
  worker that gets its hand-off discards it and takes it out (``task_revoked``);
- the older ones, in each room this worker sweeps at most once every :data:`OLD_EVERY`
  intervals (at its first sweep of the room after that long): a run that parks long after
  its revoke (a ``"wait"`` run revoked while it waited) is still found, without every sweep
  paying for every id the worker remembers;
- each id is one ``HEXISTS`` of the room's parked runs and one ``ZSCORE`` of a reservation
  for it, pipelined in one round trip, however many ids (reading the whole room instead,
  past 50 ids, made a sweep's cost grow with the room).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from celery.worker import state as worker_state

from ...core.room import WaitingRoom
from ...core.room_reads import found_in_room

FRESH = 60.0
"""Seconds after a worker learns of a revoke during which every room it sweeps is searched
for the run."""
OLD_EVERY = 30
"""Every this many sweep intervals at most, a room a worker sweeps is searched for every
revoked run the worker remembers."""


class RevokedRuns:
    """The revoked task ids one worker remembers, as its sweeps look for them (see the
    module). Used from one thread."""

    def __init__(self) -> None:
        self._learned: dict[str, float] = {}  # task id -> time.monotonic() when learned
        self._fresh: list[str] = []
        self._old: list[str] = []
        self._old_looked: dict[str, int] = {}  # key -> store ms of its last look for old ids
        self.new: list[str] = []
        """The ids learned at the last :meth:`refresh` (to look up in the journal)."""

    def refresh(self, revoked: Iterable[str] | None = None) -> None:
        """Read what the worker remembers as revoked now (``worker_state.revoked``, unless
        ``revoked`` is given): once per sweep interval is enough."""
        now = time.monotonic()
        current = _ids(worker_state.revoked if revoked is None else revoked)
        self.new = [task_id for task_id in current if task_id not in self._learned]
        self._learned = {task_id: self._learned.get(task_id, now) for task_id in current}
        self._fresh = [t for t, at in self._learned.items() if now - at < FRESH]
        self._old = [t for t, at in self._learned.items() if now - at >= FRESH]

    def to_look_for(self, key: str, now_ms: int, interval_ms: int) -> list[str]:
        """The revoked ids to look for in ``key``'s room in a sweep at ``now_ms`` (the
        store's time, epoch ms) by a fleet that sweeps each room every ``interval_ms``."""
        every = OLD_EVERY * interval_ms
        if not self._old or now_ms - self._old_looked.get(key, now_ms - every) < every:
            return self._fresh
        if len(self._old_looked) > 100_000:  # many rooms: forget, and look again soon
            self._old_looked.clear()
        self._old_looked[key] = now_ms
        return self._fresh + self._old

    def found(self, room: WaitingRoom, key: str, ids: list[str]) -> list[str]:
        """Those of ``ids`` that are parked in ``key``'s room or hold a reservation of it.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        return found_in_room(room.client, room.names, key, ids)


def _ids(revoked: Iterable[str]) -> set[str]:
    """The ids of ``revoked``: a LimitedSet (Celery's) is read through its dict of items
    (``_data``), in one step (its iterator sorts every entry, and the worker's main thread
    adds to it meanwhile); anything else is iterated."""
    return {str(task_id) for task_id in set(getattr(revoked, "_data", revoked))}
