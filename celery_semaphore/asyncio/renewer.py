"""Renewal in asyncio code: one task per event loop, renewing every slot held in that loop.

The asyncio twin of :mod:`celery_semaphore.core.heartbeat`. Each slot held in a ``hold`` is
registered with its loop's :class:`AsyncRenewer` (see :func:`renewer`). One task wakes when
the earliest slot is due and renews every slot due within half its interval in one script
call per client and cluster hash slot, so a loop holding a hundred slots pays one round trip
per tick.

Loss is judged per slot, two ways: a renewal that answers "gone" marks that slot lost, and
only that one; and a slot whose whole lease passes without a renewal that succeeded is lost
at its own deadline. The second prong holds even when a round trip hangs (a paused server,
a half-open connection): round trips run in a task of their own, cut off after one renewal
interval with :func:`asyncio.wait_for`, and the renewer waits for nothing but its wake-up
event and the next deadline or tick. A cut-off round trip counts as a failed one (the next
tick retries); it is harmless if it reached Redis, since extend never re-creates a slot that
is gone.

The task exists only while slots are held; the next slot registered starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.asyncio import RedisCluster
from redis.crc import key_slot

from ..core.calls import extend_call
from ..core.lease import RenewalPlan, RenewErrorCallback
from ..core.names import Keys
from ..core.scripts import AsyncScripts, backend_errors
from ..errors import SemaphoreBackendError

if TYPE_CHECKING:
    from .slot import AsyncSlot


@dataclass(eq=False)
class _Flight:
    """Renewals sent together, and what came back: per entry, an expiry or an error."""

    entries: list[RenewalPlan[AsyncSlot]]
    sent_at: float
    answers: dict[int, int | BaseException | None] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None

    async def send(self, timeout: float) -> None:
        """One script call per (client, shard) batch, all at once, each cut off after
        ``timeout`` seconds. Never raises: a batch's error becomes its entries' answer."""
        by_shard: dict[
            tuple[int, int], list[tuple[RenewalPlan[AsyncSlot], AsyncScripts, Keys, str, int]]
        ] = {}
        for entry in self.entries:
            scripts, keys, token, ms = entry.slot._renewal()
            cluster = isinstance(scripts.client, RedisCluster)
            shard = (id(scripts.client), key_slot(keys.slots.encode()) if cluster else 0)
            by_shard.setdefault(shard, []).append((entry, scripts, keys, token, ms))
        batches = list(by_shard.values())
        replies = await asyncio.gather(
            *(self._extend(batch, timeout) for batch in batches), return_exceptions=True
        )
        for batch, reply in zip(batches, replies, strict=True):
            for index, (entry, *_) in enumerate(batch):
                self.answers[id(entry)] = (
                    reply if isinstance(reply, BaseException) else reply[index]
                )

    @staticmethod
    async def _extend(
        batch: Sequence[tuple[RenewalPlan[AsyncSlot], AsyncScripts, Keys, str, int]], timeout: float
    ) -> list[int | None]:
        first = batch[0][0].slot
        call = extend_call([(keys, token, ms, e.slot.weight) for e, _, keys, token, ms in batch])
        with backend_errors(first.key, first.limit):
            try:
                return await asyncio.wait_for(batch[0][1].run(call), timeout)
            except asyncio.TimeoutError:
                raise SemaphoreBackendError(
                    f"Redis did not answer a renewal for semaphore {first.key!r} within "
                    f"{timeout:g}s",
                    first.key,
                    first.limit,
                ) from None


class AsyncRenewer:
    """Renews every registered slot of one event loop from one task (see the module's
    docstring). Use the loop's own instance, :func:`renewer`; :meth:`add` a slot when its
    body starts and :meth:`remove` it before releasing it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._entries: dict[int, RenewalPlan[AsyncSlot]] = {}  # id(slot) -> entry
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._flight: _Flight | None = None

    def add(self, slot: AsyncSlot, interval: float, on_error: RenewErrorCallback | None) -> None:
        """Renew ``slot`` every ``interval`` seconds (kept in proportion to its lease if the
        lease changes) until :meth:`remove`. ``on_error`` is called, in the event loop, with
        each round trip that failed without saying the slot is gone; an exception it raises
        is swallowed."""
        entry = RenewalPlan(slot, interval / slot.lease, on_error, slot._renewed_at)

        def lease_changed() -> None:
            # Renew at once: a renewal of the old lease still in flight must not be the last
            # word Redis hears.
            entry.last_sent = float("-inf")
            self._wake.set()

        slot._watch_lease(lease_changed)
        self._entries[id(slot)] = entry
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._run(), name="semaphore-renewer")
        self._wake.set()

    def remove(self, slot: AsyncSlot) -> None:
        """Stop renewing ``slot``. From then on no renewal answer touches it, so a renewal
        racing an intentional release is never taken for a loss."""
        slot._watch_lease(None)
        self._entries.pop(id(slot), None)
        self._wake.set()

    @property
    def held(self) -> int:
        """How many slots are registered."""
        return len(self._entries)

    async def _run(self) -> None:
        try:
            while self._entries:
                self._wake.clear()
                self._take_answers()
                now = time.monotonic()
                for entry in list(self._entries.values()):
                    if now >= entry.slot.deadline:
                        self._judge(entry, "no renewal succeeded within one lease")
                entries = list(self._entries.values())
                if not entries:
                    break
                # When the first slot's tick comes, every slot due within half its own
                # interval goes along: the slots fall into step, one round trip per tick.
                if self._flight is None and min(e.next_tick for e in entries) <= now:
                    self._send([e for e in entries if e.next_tick - e.interval / 2 <= now], now)
                # While a flight is out, its end wakes the loop; until then only deadlines.
                ticks = [] if self._flight is not None else [e.next_tick for e in entries]
                wake_at = min([e.slot.deadline for e in entries] + ticks)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, wake_at - time.monotonic()))
        finally:
            if self._flight is not None and self._flight.task is not None:
                self._flight.task.cancel()
            self._flight = None
            if _renewers.get(self._loop) is self:
                del _renewers[self._loop]

    def _send(self, due: list[RenewalPlan[AsyncSlot]], now: float) -> None:
        for entry in due:
            entry.last_sent = now
        flight = _Flight(due, now)
        # A round trip still unanswered after one interval is taken for stuck: cut it off.
        flight.task = self._loop.create_task(flight.send(min(e.interval for e in due)))
        flight.task.add_done_callback(lambda _: self._wake.set())
        self._flight = flight

    def _take_answers(self) -> None:
        flight = self._flight
        if flight is None or flight.task is None or not flight.task.done():
            return
        self._flight = None
        if flight.task.cancelled():  # the loop is shutting down: no verdict
            return
        for entry in flight.entries:
            slot = entry.slot
            if self._entries.get(id(slot)) is not entry:
                continue  # removed (released) while the flight was out
            answer = flight.answers.get(id(entry))
            if isinstance(answer, BaseException):
                self._report(entry, answer)
            elif not slot._renewed(flight.sent_at, slot.lease, answer):
                if not slot.released:  # not given back by the body itself meanwhile
                    slot._mark_lost("a renewal found the slot gone")
                self._entries.pop(id(slot), None)

    def _judge(self, entry: RenewalPlan[AsyncSlot], reason: str) -> None:
        if self._entries.get(id(entry.slot)) is entry and not entry.slot.released:
            entry.slot._mark_lost(reason)
            self._entries.pop(id(entry.slot), None)

    @staticmethod
    def _report(entry: RenewalPlan[AsyncSlot], error: BaseException) -> None:
        if entry.on_error is not None:
            # A broken telemetry hook must not stop renewal.
            with contextlib.suppress(Exception):
                entry.on_error(error)


_renewers: dict[asyncio.AbstractEventLoop, AsyncRenewer] = {}
"""The renewer of each event loop that holds slots; one leaves when its task ends."""


def renewer() -> AsyncRenewer:
    """The renewer of the running event loop.

    Raises:
        RuntimeError: no event loop is running in this thread.
    """
    loop = asyncio.get_running_loop()
    found = _renewers.get(loop)
    if found is None:
        found = _renewers[loop] = AsyncRenewer(loop)
    return found
