"""The waiting rooms' safety net, run on every worker's timer.

Every worker of an app with a queueing task sweeps every room under the app's prefix each
:data:`SWEEP_INTERVAL` seconds: it requeues hand-offs whose reservation lapsed, hands free
slots to the oldest parked runs, gives up runs past their ``shed_timeout``, and takes out
runs it knows to be revoked. So a room drains even when the process that should have
published a hand-off died. A sweep publishes each run to its own queue, not its hand-off
queue, which may have no consumer left (see
:mod:`~celery_semaphore.integration.handoff_queues`).
"""

from __future__ import annotations

import logging
import time

from celery import Celery
from celery.worker import state as worker_state

from ..core.admin import SemaphoreAdmin
from ..core.room import HandoffRoute
from .room import publisher_for
from .settings import app_settings, client_for

logger = logging.getLogger(__name__)

SWEEP_INTERVAL = 2.0
"""Seconds between sweeps of the waiting rooms by each worker."""
FULL_SCAN_INTERVAL = 60.0
"""Seconds between the sweeps that also SCAN the keyspace for rooms missing from the index
(a run that died between parking and indexing its room); the others read the index only."""


class RoomSweeper:
    """Sweeps ``app``'s waiting rooms when called (a worker's timer calls :meth:`sweep`).

    Args:
        app (Celery): the worker's app.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._scanned_at = -FULL_SCAN_INTERVAL  # the first sweep scans

    def sweep(self) -> None:
        """The waiting rooms' safety net: requeue lapsed hand-offs and hand free slots to the
        oldest parked runs, for every room under the app's prefix. Never raises."""
        try:
            settings = app_settings(self.app)
            admin = SemaphoreAdmin(
                client_for(self.app),
                settings.prefix,
                # The safety net publishes to each run's own queue: its hand-off queue
                # may have no consumer left.
                HandoffRoute(settings.policy.claim_timeout, publisher_for(self.app, False)),
            )
            now = time.monotonic()
            full_scan = now - self._scanned_at >= FULL_SCAN_INTERVAL
            for key in admin.rooms(full_scan=full_scan):
                self._cancel_revoked(admin, key)
                admin.sweep(key)
            if full_scan:
                self._scanned_at = now
        except Exception:
            logger.warning("could not sweep the waiting rooms", exc_info=True)

    def _cancel_revoked(self, admin: SemaphoreAdmin, key: str) -> None:
        """Take the runs of ``key``'s room that this worker knows to be revoked out of it,
        parked or holding a reservation. A worker that sees a revoked run's message does
        this too (``task_revoked``), but a reservation whose hand-off it did not see that
        way would lapse and be handed to the revoked run again, once every
        ``claim_timeout``, for as long as workers remember the revoke. Reads the room only
        when the worker knows of some revoked task."""
        revoked = worker_state.revoked
        if not revoked:
            return
        waiting = {w.waiter for w in admin.room(key)}
        waiting.update(str(h.metadata.get("reserved_for") or "") for h in admin.holders(key))
        for task_id in waiting:
            if task_id and task_id in revoked and admin.cancel(key, task_id):
                logger.info("semaphore %r: revoked task %s left the waiting room", key, task_id)
