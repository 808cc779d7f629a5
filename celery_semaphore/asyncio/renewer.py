"""Renewal in asyncio code: one task per event loop, renewing every slot held in that loop.

The asyncio twin of :mod:`celery_semaphore.core.heartbeat`. Each slot held in a ``hold`` is
registered with its loop's :class:`AsyncRenewer` (see :func:`renewer`). One task wakes when
the earliest slot is due and renews every slot due within half its interval in one script
call per client and cluster hash slot, so a loop holding a hundred slots pays one round trip
per tick.

Loss is judged per slot, two ways: a renewal that answers "gone" marks that slot lost, and
only that one; and a slot whose whole lease passes without a renewal that succeeded is lost
at its own deadline. The second prong holds even when a round trip hangs (a paused server,
a half-open connection): round trips run in a task of their own, and the renewer waits for
nothing but its wake-up event and the next deadline or tick. A round trip unanswered after
one renewal interval counts as a failed one, and is cancelled when the next flight goes; it
is harmless if it reached Redis, since extend never re-creates a slot that is gone. Those
decisions are :class:`~celery_semaphore.core.lease.Renewals`', shared with the sync
heartbeat; this module runs the task.

The task exists only while slots are held; the next slot registered starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from ..core.lease import Flight, Renewals, RenewErrorCallback

if TYPE_CHECKING:
    from .slot import AsyncSlot


class AsyncRenewer:
    """Renews every registered slot of one event loop from one task (see the module's
    docstring). Use the loop's own instance, :func:`renewer`; :meth:`add` a slot when its
    body starts and :meth:`remove` it before releasing it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._plans: Renewals[AsyncSlot] = Renewals()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sending: asyncio.Task[None] | None = None

    def add(self, slot: AsyncSlot, interval: float, on_error: RenewErrorCallback | None) -> None:
        """Renew ``slot`` every ``interval`` seconds (kept in proportion to its lease if the
        lease changes) until :meth:`remove`. ``on_error`` is called, in the event loop, with
        each round trip that failed without saying the slot is gone; an exception it raises
        is swallowed."""
        self._plans.add(slot, interval, on_error, self._wake.set)
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._run(), name="semaphore-renewer")
        self._wake.set()

    def remove(self, slot: AsyncSlot) -> None:
        """Stop renewing ``slot``. From then on no renewal answer touches it, so a renewal
        racing an intentional release is never taken for a loss."""
        self._plans.remove(slot)
        self._wake.set()

    async def _run(self) -> None:
        try:
            while self._plans.plans:
                self._wake.clear()
                flight, wake_at = self._plans.step(time.monotonic())
                self._plans.report()
                if flight is not None:
                    if self._sending is not None:
                        self._sending.cancel()  # taken for stuck
                    self._sending = self._loop.create_task(self._send(flight))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, wake_at - time.monotonic()))
        finally:
            if self._sending is not None:
                self._sending.cancel()
            self._plans.flight = None
            if _renewers.get(self._loop) is self:
                del _renewers[self._loop]

    async def _send(self, flight: Flight[AsyncSlot]) -> None:
        """All the flight's script calls at once; its end wakes the renewer (a cancelled
        one gives no answer)."""
        batches = flight.batches()
        replies = await asyncio.gather(
            *(batch.slot._scripts.run(batch.call) for batch in batches), return_exceptions=True
        )
        for batch, reply in zip(batches, replies, strict=True):
            flight.answer(batch, reply)
        flight.done = True
        self._wake.set()


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
