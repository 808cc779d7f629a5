"""A worker's upkeep, in a thread of its own: it checks the store, and sweeps the worker's
share of the waiting rooms, off the worker's main loop.

The worker's main loop (kombu's event loop and timer) receives messages and starts runs; a
round trip there holds up every message behind it. So the bootstep starts one daemon thread
per worker, in its main process (a prefork worker's pool processes have none), which:

- every ``semaphore_sweep_interval`` seconds (2 s), checks that the store answers
  (:class:`~.store_watch.StoreWatch`) and, for an app with a queueing task, does the
  sweeper's :meth:`~.waiting_room.sweeps.RoomSweeper.tick` (the journal keeper, the
  revoked ids, the fleet's periodic scan);
- in between, takes the rooms due for a sweep a page at a time, and sweeps them: at once
  again while a page comes back full, else once the next room is due (no sooner than an
  eighth, no later than a quarter of an interval, so that a room is swept within about a
  quarter of an interval of its time, and each worker asks the index at most about 8 times
  an interval when nothing is due).

The thread never raises out (each step logs its own failures), stops when the worker stops
(:meth:`Upkeep.stop`), and, a daemon, cannot keep a worker's process alive.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from celery import Celery

from ..core.admin import SemaphoreAdmin
from . import stats
from .settings import app_settings, client_for
from .store_watch import StoreWatch
from .waiting_room.sweeps import PAGE, RoomSweeper

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0
"""Seconds :meth:`Upkeep.stop` waits for the thread to finish what it is doing."""


class Upkeep:
    """The upkeep thread of one worker (see the module).

    Args:
        watch (StoreWatch): the worker's watch on its store.
        sweeper (RoomSweeper | None): the sweeper of an app with a queueing task; None: the
            thread only watches the store.
        interval (float): seconds between two checks of the store, and between two sweeps of
            one room by the fleet (> 0).
        reachable (bool): whether the store answered the check made at start-up.
        timer (Any): the worker's ``kombu`` timer, or None (see :meth:`start`).
    """

    def __init__(
        self,
        watch: StoreWatch,
        sweeper: RoomSweeper | None,
        interval: float,
        reachable: bool = False,
        timer: Any = None,
    ) -> None:
        self.watch, self.sweeper, self.interval = watch, sweeper, interval
        self._reachable = reachable
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._timer, self._wakes = timer, None

    def start(self) -> None:
        """Start the thread (a second call does nothing). With the worker's timer, also put
        an entry on it that does nothing every interval: the worker's main loop then wakes
        at least that often, as it did when it swept on that timer. An in-process worker
        (``celery.contrib.testing``) notices a request to stop only when its loop wakes,
        which on a quiet AMQP connection and a timer with nothing due soon can take 10 s."""
        if self._thread is not None:
            return
        if self._timer is not None:
            self._wakes = self._timer.call_repeatedly(self.interval, lambda: None)
        self._thread = threading.Thread(target=self._run, name="celery-semaphore-upkeep",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Stop the thread, and wait up to ``timeout`` seconds for it to end (a sweep under
        way finishes its room first). Never raises.

        Returns:
            bool: whether it ended in time (one that did not is a daemon, and ends with the
            process).
        """
        self._stopping.set()
        if self._wakes is not None:
            self._wakes.cancel()
            self._wakes = None
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the semaphore upkeep thread did not stop within %gs", timeout)
            return False
        return True

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # never out of the thread: the worker goes on without it
            logger.error("the semaphore upkeep thread stopped", exc_info=True)

    def _loop(self) -> None:
        next_tick = time.monotonic()  # the thread's first step is a tick
        while not self._stopping.is_set():
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + self.interval
                self._reachable = self.watch.check()
                if self._reachable and self.sweeper is not None:
                    self.sweeper.tick()
            wait = next_tick - time.monotonic()
            if self._reachable and self.sweeper is not None and not self._stopping.is_set():
                due = self.sweeper.sweep_due()
                if due is None:
                    self._reachable = False  # until the next check says otherwise
                elif len(due.keys) >= PAGE or 0 <= due.next_ms <= due.now_ms:
                    wait = 0.0  # more rooms are due than a page: go on at once
                else:
                    until = (due.next_ms - due.now_ms) / 1000 if due.next_ms >= 0 else wait
                    quarter = self.interval / 4
                    # Jittered, so that the workers of a fleet do not ask in step.
                    wait = min(wait, max(quarter / 2, min(until, quarter)))
                    wait *= random.uniform(0.9, 1.1)
            self._stopping.wait(max(0.0, wait))


def start_upkeep(app: Celery, worker: str, sweeps: bool, timer: Any = None) -> Upkeep:
    """Check ``app``'s store once now, in the caller's thread, so that the start-up checks
    of a worker (its counters reset, the server's warnings, the persistence line) come before
    any of its runs; then start the upkeep thread.

    Args:
        app (Celery): the worker's app (one with a bounded task).
        worker (str): the worker's node name.
        sweeps (bool): whether the app has a queueing task (then the thread also sweeps).
        timer (Any): the worker's ``kombu`` timer (see :meth:`Upkeep.start`), or None.

    Returns:
        Upkeep: the started thread's handle, for the worker to stop.
    """

    def first_reach() -> None:
        stats.reset(app, worker)
        admin = SemaphoreAdmin(client_for(app), app_settings(app).prefix)
        for warning in admin.server_warnings():
            logger.warning("%s", warning)

    watch = StoreWatch(app, sweeps, first_reach)
    sweeper = RoomSweeper(app, worker) if sweeps else None
    reachable = watch.check()
    upkeep = Upkeep(watch, sweeper, app_settings(app).sweep_interval, reachable, timer)
    upkeep.start()
    return upkeep
