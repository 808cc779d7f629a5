"""The waiting rooms' safety net, which the workers of a fleet share out between them.

Each waiting room is swept by the whole fleet, not by every worker, when something in it
falls due: the room index (:class:`~celery_semaphore.core.room_index.RoomIndex`) scores each
room with when it is next due, and a worker takes a page of due rooms at a time
(``due_rooms.lua``), which pushes each one interval ahead (so W workers split the rooms
between them, and a room whose sweeper died is due again one interval later), sweeps the
page's rooms in one pipelined round trip, and scores each room with when its sweep says it
next needs one: its earliest reservation lapse, deadline, or (while anyone waits) holder's
lease end, and at the latest a quarter of the room's TTL on (``semaphore_room_ttl``: 6 hours
by default), to keep its keys alive. What the sweep could not see brings the room's score
down itself (a reservation made later, a slot left free for a sweep, a raised limit, a
waiter with a deadline: see sweep.lua), so a room where nothing changes costs the fleet
nothing but that sweep a quarter TTL, however many rooms there are.

A sweep requeues hand-offs whose reservation lapsed, hands free slots to the oldest parked
runs, gives up runs past their ``queue_timeout``, and takes out runs the
worker knows to be revoked (see :mod:`.revoked`) and runs whose ``expires`` has passed. So a
room drains even when the process that should have published a hand-off died, and even
when the worker that took the room to sweep died too: it is due again one interval later,
for another. A sweep publishes each run to its own queue, not its hand-off queue, which may
have no consumer left (see :mod:`~celery_semaphore.integration.waiting_room.queues`).

A run a sweep takes out without running it (revoked, expired) no longer has a message
anywhere that a worker could discard, so the sweep stores its end as Celery would (see
:mod:`.parking`).

Rooms missing from the index (a run that died between parking and indexing) are found by a
SCAN of the keyspace once every :data:`FULL_SCAN_INTERVAL` seconds by one worker of the
fleet, the one that takes the lease for it (see :meth:`RoomIndex.backstop`).

The worker's upkeep thread (:class:`~celery_semaphore.integration.worker.Upkeep`) drives
this: a :meth:`RoomSweeper.tick` each interval and a :meth:`RoomSweeper.sweep_due` whenever
rooms are due, off the worker's main loop.
"""

from __future__ import annotations

import logging
import socket
import sqlite3
import time
from collections.abc import Sequence

from celery import Celery

from ...core.handoff import HandoffRoute
from ...core.replies import DueRooms, Handoff
from ...core.room import WaitingRoom
from ...errors import SemaphoreBackendError
from .. import stats
from ..settings import app_settings, client_for, forget, journal_for
from .handoffs import publisher_for
from .keeper import JournalKeeper
from .parking import context_of, end_as_revoked, expires_at, message_of
from .revoked import RevokedRuns

logger = logging.getLogger(__name__)

FULL_SCAN_INTERVAL = 60.0
"""Seconds between two SCANs of the keyspace, by the whole fleet, for rooms missing from the
index (a run that died between parking and indexing)."""
PAGE = 100
"""Rooms a worker takes from the index at a time."""


class RoomSweeper:
    """Sweeps ``app``'s due waiting rooms when called (see the module).

    Args:
        app (Celery): the worker's app.
        worker (str): the worker's node name (its counters, and the scan lease's owner);
            "": the host's name, and no counter.
    """

    def __init__(self, app: Celery, worker: str = "") -> None:
        self.app = app
        self.worker = worker
        self._publish = publisher_for(app, False)
        self._expired: list[tuple[str, Handoff]] = []
        self._journal = JournalKeeper(app)
        self._revoked = RevokedRuns()
        self._room: WaitingRoom | None = None

    def _waiting_room(self) -> WaitingRoom:
        if self._room is None:
            settings = app_settings(self.app)
            self._room = WaitingRoom(
                client_for(self.app),
                settings.prefix,
                # The safety net publishes to each run's own queue: its hand-off queue
                # may have no consumer left.
                HandoffRoute(settings.policy.claim_timeout, self._give_up_or_publish),
            )
        return self._room

    def tick(self) -> None:
        """Once per interval: look up a page of this host's journal of parked runs (see
        :mod:`.keeper`), read what the worker knows to be revoked, and scan the keyspace for
        unindexed rooms if it is this worker's turn for the fleet. Never raises."""
        self._journal.keep()
        try:
            self._revoked.refresh()
            room = self._waiting_room()
            self._cancel_journaled(room)
            found = room.index.backstop(
                FULL_SCAN_INTERVAL,
                self.worker or socket.gethostname(),
                app_settings(self.app).room_ttl,
            )
            if found:
                logger.info("found %d waiting room(s) missing from the room index", found)
        except SemaphoreBackendError as exc:  # the store's watch reports an outage
            logger.warning("could not scan for the waiting rooms: %s", exc)
        except Exception:
            logger.warning("could not scan for the waiting rooms", exc_info=True)

    def sweep_due(self) -> DueRooms | None:
        """Take a page of the rooms due for a sweep (at most :data:`PAGE`) and sweep them.
        Never raises.

        Returns:
            DueRooms | None: what was taken (its ``next_ms`` says when to look again), or
            None when the store failed.
        """
        try:
            settings = app_settings(self.app)
            room = self._waiting_room()
            interval = settings.sweep_interval
            due = room.index.due(interval, PAGE, settings.room_ttl)
            interval_ms = round(interval * 1000)
            for key in due.keys:
                self._cancel_revoked(room, key, due.now_ms, interval_ms)
            try:  # one round trip for the page, one to score its rooms
                room.sweep_many(due.keys, taken_ms=due.taken_ms)
            finally:
                self._end_expired(room)
            if due.keys:
                stats.bump(self.app, self.worker, "swept", len(due.keys))
            return due
        except SemaphoreBackendError as exc:  # the store's watch reports an outage
            logger.warning("could not sweep the waiting rooms: %s", exc)
        except Exception:
            logger.warning("could not sweep the waiting rooms", exc_info=True)
        finally:
            self._expired.clear()
        return None

    def _give_up_or_publish(self, key: str, handoffs: Sequence[Handoff]) -> None:
        """The sweep's publisher: a give-up of a run whose ``expires`` has passed is kept
        for :meth:`_end_expired`, since its message would only be discarded by the worker
        that fetched it, and would wait for that behind its queue's backlog meanwhile; every
        other hand-off and give-up is published to its run's own queue."""
        now = time.time()
        rest = []
        for handoff in handoffs:
            if handoff.give_up:
                expires = expires_at(message_of(handoff.payload)["options"].get("expires"))
                if expires is not None and expires <= now:
                    self._expired.append((key, handoff))
                    continue
            rest.append(handoff)
        if rest:
            self._publish(key, rest)

    def _end_expired(self, room: WaitingRoom) -> None:
        """Take the expired runs this sweep gave up out of their rooms, and store each as
        Celery stores an expired task it discards (REVOKED, "expired")."""
        while self._expired:
            key, handoff = self._expired.pop()
            if room.cancel(key, handoff.waiter):
                forget(self.app, handoff.waiter)
                message = message_of(handoff.payload)
                end_as_revoked(self.app, handoff.waiter, "expired", context_of(message))

    def _cancel_revoked(self, room: WaitingRoom, key: str, now_ms: int, interval_ms: int) -> None:
        """Take the runs of ``key``'s room that this worker knows to be revoked out of it,
        parked or holding a reservation (see :mod:`.revoked` for which ids it looks for, and
        what that costs). A worker that sees a revoked run's message does this too
        (``task_revoked``), but a reservation whose hand-off it did not see that way would
        lapse and be handed to the revoked run again, once every ``claim_timeout``. A run
        taken out is stored REVOKED (Celery's revoke stores nothing for a run that may be
        running, and a parked one is STARTED with ``task_track_started``)."""
        ids = self._revoked.to_look_for(key, now_ms, interval_ms)
        for task_id in self._revoked.found(room, key, ids):
            self._take_out(room, key, task_id)

    def _cancel_journaled(self, room: WaitingRoom) -> None:
        """Take the runs revoked since the last tick that this host parked out of their
        rooms, found by their keys in the host's journal (see :mod:`.revoked`)."""
        journal = journal_for(self.app)
        if journal is None or not self._revoked.new:
            return
        try:
            found = journal.keys_of(self._revoked.new)
        except (sqlite3.Error, OSError) as exc:
            logger.warning("could not read the waiting room's journal: %s", exc)
            return
        for task_id, keys in found.items():
            self._take_out(room, keys[0], task_id)  # a run of several keys leaves them all

    def _take_out(self, room: WaitingRoom, key: str, task_id: str) -> None:
        if room.cancel(key, task_id):
            forget(self.app, task_id)
            logger.info("semaphore %r: revoked task %s left the waiting room", key, task_id)
            # Nothing else will: no worker holds a message of it to discard.
            end_as_revoked(self.app, task_id, "revoked")
