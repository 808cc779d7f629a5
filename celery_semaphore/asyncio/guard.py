"""Run a body under an :class:`AsyncSlot` (or an :class:`AsyncSlotGroup`): renew it, stop the
body if asked when the slot is lost, give the slot back on every path, and judge whether it
held.

The asyncio twin of :func:`celery_semaphore.core.semaphore.guard`. The one new piece is the
interrupt: where the sync semaphore raises inside the body's thread, here the body's task
is cancelled, and the cancellation is turned into :class:`SemaphoreLeaseLostError` when it
leaves the block.

Renewal, the asyncio twin of :mod:`celery_semaphore.core.heartbeat`, is one task per event
loop, renewing every slot held in that loop: each slot held in a ``hold`` is registered with
its loop's :class:`AsyncRenewer` (see :func:`renewer`). The task wakes when the earliest slot
is due and renews every slot due within half its interval in one script call per client and
cluster hash slot, so a loop holding a hundred slots pays one round trip per tick.

Loss is judged per slot, two ways: a renewal that answers "gone" marks that slot lost, and
only that one; and a slot whose whole lease passes without a renewal that succeeded is lost
at its own deadline. The second prong holds even when a round trip hangs (a paused server,
a half-open connection): round trips run in a task of their own, and the renewer waits for
nothing but its wake-up event and the next deadline or tick. A round trip unanswered after
one renewal interval counts as a failed one, and is cancelled when the next flight goes; it
is harmless if it reached Redis, since extend never re-creates a slot that is gone. Those
decisions are :class:`~celery_semaphore.core.lease.Renewals`', shared with the sync
heartbeat; this module runs the task, which exists only while slots are held (the next slot
registered starts a new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from ..core.feedback import BackOff
from ..core.lease import Flight, Renewals, RenewErrorCallback
from ..errors import SemaphoreBackendError
from .group import AsyncSlotGroup
from .slot import AsyncSlot

S = TypeVar("S", AsyncSlot, AsyncSlotGroup)

logger = logging.getLogger(__name__)


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


class _Interrupt:
    """While armed, a loss of ``slot`` cancels ``task``; afterwards, tells that cancellation
    from any other."""

    def __init__(self, slot: AsyncSlot | AsyncSlotGroup, task: asyncio.Task[object]) -> None:
        self._task = task
        self._armed = True
        self.fired = False
        slot.when_lost(self._fire)

    def _fire(self, slot: AsyncSlot | AsyncSlotGroup) -> None:
        if self._armed and not self.fired:
            self.fired = True
            self._task.cancel(f"semaphore slot of {slot.key!r} lost")

    def disarm(self) -> bool:
        """Stop watching; True when the slot's loss cancelled the task and nothing else has
        asked to cancel it (so the cancellation can be taken back)."""
        self._armed = False
        if not self.fired:
            return False
        self.fired = False
        uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+
        # Without uncancel (3.10) another request cannot be told apart: ours it is.
        return uncancel is None or uncancel() == 0


@contextlib.asynccontextmanager
async def guard(
    slot: S,
    interval: float | None,
    on_renew_error: RenewErrorCallback | None = None,
    interrupt: bool = False,
) -> AsyncIterator[S]:
    """Renew ``slot`` while the block runs, then release it and judge whether it held.

    The slot leaves the loop's renewer before the release, so a renewal racing an
    intentional release is never mistaken for a loss. The loss deadline is checked again
    when the block ends (a body that blocks the event loop starves the renewer), and the
    release's own answer is consulted. The release runs to its end even if the block is
    cancelled.

    Args:
        slot (AsyncSlot | AsyncSlotGroup): a freshly acquired slot, or the slots of several
            keys (each renewed, all released); released on every path out of the block.
        interval (float | None): seconds between renewals; None for no renewal.
        on_renew_error (Callable[[BaseException], object] | None): see
            :meth:`AsyncSemaphore.hold`.
        interrupt (bool): cancel the task running the block the moment the slot is lost.

    Raises:
        SemaphoreLeaseLostError: the slot was lost while the block ran, and the block ended
            normally or was cancelled by ``interrupt``.
    """
    members = slot.slots if isinstance(slot, AsyncSlotGroup) else (slot,)
    beat = None
    if interval is not None:
        beat = renewer()
        for member in members:
            beat.add(member, interval, on_renew_error)
    task = asyncio.current_task()
    stop = _Interrupt(slot, task) if interrupt and task is not None else None
    failed, outcome = True, None
    try:
        yield slot
        failed = False
    except BackOff as exc:
        outcome = exc
        raise
    except asyncio.CancelledError:
        if stop is None or not stop.disarm():
            raise
        failed = False  # cancelled because the slot was lost: report the loss below
    finally:
        if stop is not None:
            stop.disarm()  # a body that swallowed the cancellation leaves none pending
        if beat is not None:
            for member in members:
                beat.remove(member)
        slot._check_deadline()
        try:
            await slot.__aexit__(type(outcome), outcome, None)  # a release, or a back-off
        except SemaphoreBackendError:
            # The lease runs out by itself; a failed release must not mask the outcome.
            logger.warning("could not release slot of semaphore %r", slot.key, exc_info=True)
    if not failed and slot.lost.is_set():
        raise slot.lease_lost_error()
