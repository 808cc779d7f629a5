"""The renewal thread: one per process, renewing every slot the process holds.

Each held slot is registered with the process's :class:`Renewer` (see :func:`renewer`). One
daemon thread wakes when the earliest slot is due, and renews every slot due within half its
interval in one script call per Redis client and cluster hash slot, so a process holding a
hundred slots pays one round trip per tick, not a hundred.

Loss is judged per slot, two ways (the leased-semaphore spec's "two-pronged" rule): a
renewal that answers "gone" marks that slot lost, and only that one; and a slot whose whole
lease passes without a renewal that succeeded is lost at its own deadline. The second prong
must hold even when a round trip hangs (a paused server, a half-open TCP connection, a
client with no socket timeout), so round trips are made by a sender thread that the renewer
waits for no longer than the next deadline, or one renewal interval. A round trip still
unanswered then counts as failed; its sender is abandoned, and a fresh one takes the next
flight. Those decisions are :class:`~celery_semaphore.core.lease.Renewals`', shared with the
asyncio renewer; this module runs the threads.

The threads exist only while slots are held (and for :data:`LINGER` seconds after), and a
forked child starts its own. A slot released before its first renewal is due never starts
the sender thread.

The module also keeps the process's release thread (:func:`release_later`): a Celery run
hands its slot's release to it and goes on, and it sends the release at once; releases
handed off while its round trip is out go together in the next one, one per client. A
process that runs one task at a time (:data:`INLINE`) sends them itself instead.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from . import process
from .lease import Flight, Renewals, RenewErrorCallback
from .slot import Slot, give_back

LINGER = 2.0
"""Seconds the renewal thread outlives the last slot it renewed, so that a worker running
short tasks one after another does not start a thread for each."""


class _Sender:
    """A thread that sends flights, one at a time, until told to stop or abandoned."""

    def __init__(self, wake: Callable[[], object]) -> None:
        self.jobs: queue.SimpleQueue[Flight[Slot] | None] = queue.SimpleQueue()
        self.busy = False
        self._wake = wake
        threading.Thread(target=self._run, name="semaphore-renew-send", daemon=True).start()

    def _run(self) -> None:
        while (flight := self.jobs.get()) is not None:
            self.busy = True
            for batch in flight.batches():
                try:
                    reply: list[int | None] | BaseException = batch.slot._scripts.run(batch.call)
                except BaseException as exc:  # reported to each slot's on_renew_error
                    reply = exc
                flight.answer(batch, reply)
            flight.done = True
            self.busy = False
            self._wake()


class Renewer:
    """Renews every registered slot from one thread (see the module's docstring).

    Use the process's own instance, :func:`renewer`; :meth:`add` a slot when its body starts
    and :meth:`remove` it before releasing it.
    """

    def __init__(self) -> None:
        self.pid = process.pid()
        self._lock = threading.Lock()
        self._plans: Renewals[Slot] = Renewals()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._sender: _Sender | None = None
        # The loop's plan, read by add() to wake it only for a slot due sooner; and the
        # adds since its last look, so that one made while it plans is never missed.
        self._wake_at = float("-inf")
        self._added = 0
        self._last_used = time.monotonic()  # of the last add or remove: the linger's start

    def add(self, slot: Slot, interval: float, on_renew_error: RenewErrorCallback | None) -> None:
        """Renew ``slot`` every ``interval`` seconds (kept in proportion to its lease if the
        lease changes) until :meth:`remove`. ``on_renew_error`` is called, in the renewal
        thread, with each round trip that failed without saying the slot is gone; an
        exception it raises is swallowed."""
        with self._lock:
            plan = self._plans.add(slot, interval, on_renew_error, self._wake.set)
            self._added += 1
            self._last_used = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="semaphore-renewer", daemon=True
                )
                self._thread.start()
            elif plan.next_tick < self._wake_at:
                # Waking the thread costs a context switch (and the GIL) on every short
                # task: only a slot due before the thread's next wake needs it.
                self._wake.set()

    def remove(self, slot: Slot) -> None:
        """Stop renewing ``slot``. Once this returns, no renewal answer touches it, so a
        renewal racing an intentional release is never taken for a loss. The thread is not
        woken: it finds the slot gone when it next wakes."""
        with self._lock:
            self._plans.remove(slot)
            self._last_used = time.monotonic()

    def _loop(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                flight, wake_at = self._plans.step(now)
                added, idle_until = self._added, self._last_used + LINGER
                if not self._plans.plans:
                    if now >= idle_until:
                        if self._sender is not None:
                            self._sender.jobs.put(None)  # told to end once it is idle
                            self._sender = None
                        self._plans.flight = None
                        self._thread = None
                        return
                    wake_at = idle_until
            self._plans.report()
            if flight is not None:
                self._send(flight)
            # Sleep until wake_at (or a wake-up), unless a slot was added since the step
            # above: then step again at once.
            with self._lock:
                if self._added != added:
                    continue
                self._wake_at = wake_at
            self._wake.wait(max(0.0, wake_at - time.monotonic()))
            self._wake_at = float("-inf")  # awake: it plans again before it sleeps, seeing any add

    def _send(self, flight: Flight[Slot]) -> None:
        if self._sender is None or self._sender.busy:
            if self._sender is not None:
                # Stuck on a round trip that has not answered: leave it behind, told to end
                # once that round trip returns.
                self._sender.jobs.put(None)
            self._sender = _Sender(self._wake.set)
        self._sender.jobs.put(flight)


_renewer: Renewer | None = None
_renewer_lock = threading.Lock()


def renewer() -> Renewer:
    """The renewer of this process (a forked child gets a fresh one: threads do not survive
    a fork)."""
    global _renewer
    with _renewer_lock:
        if _renewer is None or _renewer.pid != process.pid():
            _renewer = Renewer()
        return _renewer


def _send_releases(jobs: queue.SimpleQueue[Slot | threading.Event]) -> None:
    while True:  # what was handed off while the last round trip was out goes in the next
        batch = [jobs.get()]
        while not jobs.empty() and len(batch) < 256:
            batch.append(jobs.get())
        give_back([job for job in batch if isinstance(job, Slot)])
        for job in batch:
            if isinstance(job, threading.Event):  # a flush, waiting for what came before it
                job.set()


_releases: tuple[int, queue.SimpleQueue[Slot | threading.Event]] | None = None
# Whether release_later gives the slot back in the caller's thread: set in a Celery prefork
# pool process, which runs one task at a time and has nothing to do while the release is out;
# there the hand-off to the thread (its wake-up, the GIL passed back and forth) costs more CPU
# than the wait it saves (see the performance page).
INLINE = False


def release_later(slot: Slot) -> None:
    """Give ``slot`` back, as a run that ended well, from this process's release thread,
    which sends it at once (with any handed off while its last round trip was out:
    :func:`give_back`); the caller does not wait. A failure is logged, and a lost reply put
    right, as for :meth:`Slot.release`; a release that finds the slot gone marks it lost
    then. What is still queued as the interpreter ends is sent first (an ``atexit`` hook); a
    Celery pool process, which ends without that, calls :func:`flush_releases`. With
    :data:`INLINE` set, the same is done before this returns."""
    if INLINE:
        give_back([slot])
        return
    global _releases
    with _renewer_lock:
        if _releases is None or _releases[0] != process.pid():  # a forked child's is new
            _releases = process.pid(), queue.SimpleQueue()
            threading.Thread(target=_send_releases, args=(_releases[1],), daemon=True,
                             name="semaphore-release").start()  # fmt: skip
        _releases[1].put(slot)


def flush_releases() -> None:
    """Send what :func:`release_later` still holds, and wait until it is answered."""
    releases, done = _releases, threading.Event()
    if releases is not None and releases[0] == process.pid():
        releases[1].put(done)
        done.wait()


atexit.register(flush_releases)


def threads() -> list[Any]:
    """The renewal threads alive in this process (for the benchmark and tests)."""
    return [t for t in threading.enumerate() if t.name.startswith("semaphore-renew")]
