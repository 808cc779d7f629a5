"""Run a body under an :class:`AsyncSlot` (or an :class:`AsyncSlotGroup`): renew it, stop the
body if asked when the slot is lost, give the slot back on every path, and judge whether it
held.

The asyncio twin of :func:`celery_semaphore.core.semaphore.guard`. The one new piece is the
interrupt: where the sync semaphore raises inside the body's thread, here the body's task
is cancelled, and the cancellation is turned into :class:`SemaphoreLeaseLostError` when it
leaves the block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

from ..core.feedback import BackOff
from ..core.lease import RenewErrorCallback
from ..errors import SemaphoreBackendError
from .group import AsyncSlotGroup
from .renewer import renewer
from .slot import AsyncSlot

S = TypeVar("S", AsyncSlot, AsyncSlotGroup)

logger = logging.getLogger(__name__)


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
