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
waits for no longer than the next deadline or tick. A sender still stuck at the next tick is
abandoned, and a fresh one takes the next batch; an abandoned round trip is harmless, since
extend never re-creates a member that is gone.

The threads exist only while slots are held (and for :data:`LINGER` seconds after), and a
forked child starts its own. A slot released before its first renewal is due never starts
the sender thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.cluster import RedisCluster
from redis.crc import key_slot

from . import process
from .lease import RenewalPlan, RenewErrorCallback
from .names import Keys
from .scripts import Scripts, backend_errors

if TYPE_CHECKING:
    from .slot import Slot


LINGER = 2.0
"""Seconds the renewal thread outlives the last slot it renewed, so that a worker running
short tasks one after another does not start a thread for each."""


@dataclass(eq=False)
class _Batch:
    """Renewals sent together: one script call per (client, shard) batch."""

    entries: list[RenewalPlan[Slot]]
    sent_at: float
    on_done: Callable[[], object]
    done: threading.Event = field(default_factory=threading.Event)
    answers: dict[int, int | None] = field(default_factory=dict)  # id(entry) -> expiry
    error: BaseException | None = None

    def send(self) -> None:
        """Run in the sender thread; never raises."""
        try:
            batches: dict[
                tuple[int, int], list[tuple[RenewalPlan[Slot], Scripts, Keys, str, int]]
            ] = {}
            for entry in self.entries:
                scripts, keys, token, ms = entry.slot._renewal()
                # On a cluster, one call per hash slot; elsewhere, one per client.
                cluster = isinstance(scripts.client, RedisCluster)
                shard = (id(scripts.client), key_slot(keys.slots.encode()) if cluster else 0)
                batches.setdefault(shard, []).append((entry, scripts, keys, token, ms))
            for rows in batches.values():
                first = rows[0][0].slot
                with backend_errors(first.key, first.limit):
                    expiries = rows[0][1].extend(
                        [(k, token, ms, e.slot.weight) for e, _, k, token, ms in rows]
                    )
                for (entry, *_), expiry in zip(rows, expiries, strict=True):
                    self.answers[id(entry)] = expiry
        except BaseException as exc:  # reported to each slot's on_renew_error, then retried
            self.error = exc
        finally:
            self.done.set()
            self.on_done()


class _Sender:
    """A thread that sends batches, one at a time, until told to stop or abandoned."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self.busy_with: _Batch | None = None
        thread = threading.Thread(target=self._run, name="semaphore-renew-send", daemon=True)
        thread.start()

    def _run(self) -> None:
        while (batch := self.jobs.get()) is not None:
            self.busy_with = batch
            batch.send()
            self.busy_with = None


class Renewer:
    """Renews every registered slot from one thread (see the module's docstring).

    Use the process's own instance, :func:`renewer`; :meth:`add` a slot when its body starts
    and :meth:`remove` it before releasing it.
    """

    def __init__(self) -> None:
        self.pid = process.pid()
        self._lock = threading.Lock()
        self._entries: dict[int, RenewalPlan[Slot]] = {}  # id(slot) -> entry
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._sender: _Sender | None = None
        self._in_flight: _Batch | None = None
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
        entry = RenewalPlan(slot, interval / slot.lease, on_renew_error, slot._renewed_at)

        def lease_changed() -> None:
            # Renew at once: a renewal of the old lease still in flight must not be the last
            # word Redis hears.
            entry.last_sent = float("-inf")
            self._wake.set()

        slot._watch_lease(lease_changed)
        with self._lock:
            self._entries[id(slot)] = entry
            self._added += 1
            self._last_used = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="semaphore-renewer", daemon=True
                )
                self._thread.start()
            elif entry.next_tick < self._wake_at:
                # Waking the thread costs a context switch (and the GIL) on every short
                # task: only a slot due before the thread's next wake needs it.
                self._wake.set()

    def remove(self, slot: Slot) -> None:
        """Stop renewing ``slot``. Once this returns, no renewal answer touches it, so a
        renewal racing an intentional release is never taken for a loss. The thread is not
        woken: it finds the slot gone when it next wakes."""
        slot._watch_lease(None)
        with self._lock:
            self._entries.pop(id(slot), None)
            self._last_used = time.monotonic()

    @property
    def held(self) -> int:
        """How many slots are registered."""
        return len(self._entries)

    def _loop(self) -> None:
        while True:
            self._wake.clear()
            self._take_answers()
            now = time.monotonic()
            with self._lock:
                entries = list(self._entries.values())
                added, idle_until = self._added, self._last_used + LINGER
                if not entries and now >= idle_until:
                    self._stop_sender()
                    self._thread = None
                    return
            if not entries:
                self._sleep(added, idle_until)
                continue
            for entry in entries:
                if now >= entry.slot.deadline:
                    self._judge(entry, "no renewal succeeded within one lease")
            # When the first slot's tick comes, every slot due within half its own interval
            # goes along: the slots fall into step, and each tick is one round trip.
            due = []
            if min(e.next_tick for e in entries) <= now:
                due = [e for e in entries if e.next_tick - e.interval / 2 <= now]
            flight = self._in_flight
            # A batch still unanswered after a whole interval is taken for stuck: send anew.
            if due and (flight is None or now - flight.sent_at >= min(e.interval for e in due)):
                self._send(due, now)
            ticks = [e.next_tick for e in entries if e.last_sent != now]
            self._sleep(added, min([e.slot.deadline for e in entries] + ticks + [now + 3600.0]))

    def _sleep(self, added: int, wake_at: float) -> None:
        """Wait until ``wake_at`` (or a wake-up), unless a slot was added since the loop took
        its entries at ``added``: then plan again at once."""
        with self._lock:
            if self._added != added:
                return
            self._wake_at = wake_at
        self._wake.wait(max(0.0, wake_at - time.monotonic()))
        self._wake_at = float("-inf")  # awake: it plans again before it sleeps, seeing any add

    def _send(self, due: Sequence[RenewalPlan[Slot]], now: float) -> None:
        if self._sender is None or self._sender.busy_with is not None:
            if self._sender is not None:
                # Stuck on a round trip that has not answered: leave it behind, told to end
                # once that round trip returns.
                self._sender.jobs.put(None)
            self._sender = _Sender()
        for entry in due:
            entry.last_sent = now
        self._in_flight = _Batch(list(due), now, self._wake.set)
        self._sender.jobs.put(self._in_flight)

    def _take_answers(self) -> None:
        batch = self._in_flight
        if batch is None or not batch.done.is_set():
            return
        self._in_flight = None
        for entry in batch.entries:
            if batch.error is not None:
                self._report(entry, batch.error)
                continue
            slot = entry.slot
            seconds = slot.lease
            with self._lock:
                if self._entries.get(id(slot)) is not entry:
                    continue  # removed (released) while the batch was in flight
                if not slot._renewed(batch.sent_at, seconds, batch.answers.get(id(entry))):
                    if not slot.released:  # not given back by the body itself meanwhile
                        slot._mark_lost("a renewal found the slot gone")
                    self._entries.pop(id(slot), None)

    def _judge(self, entry: RenewalPlan[Slot], reason: str) -> None:
        with self._lock:
            if self._entries.get(id(entry.slot)) is entry and not entry.slot.released:
                entry.slot._mark_lost(reason)
                self._entries.pop(id(entry.slot), None)

    def _report(self, entry: RenewalPlan[Slot], error: BaseException) -> None:
        if entry.on_error is not None:
            # A broken telemetry hook must not stop renewal.
            with contextlib.suppress(Exception):
                entry.on_error(error)

    def _stop_sender(self) -> None:
        if self._sender is not None:
            self._sender.jobs.put(None)
            self._sender = None
        self._in_flight = None


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


def threads() -> list[Any]:
    """The renewal threads alive in this process (for the benchmark and tests)."""
    return [t for t in threading.enumerate() if t.name.startswith("semaphore-renew")]
