"""Hold a slot for a block: renew it while the block runs, then release it and judge
whether it held. Used by :meth:`Semaphore.hold` and by the Celery glue around each run."""

from __future__ import annotations

import logging
from typing import Generic, TypeVar

from .group import SlotGroup
from .heartbeat import Renewer, renewer
from .lease import RenewErrorCallback
from .slot import Slot

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=Slot | SlotGroup)


class guard(Generic[S]):
    """Renew ``slot`` while the ``with`` block runs, then release it and judge whether it
    held; entering gives the slot.

    The slot leaves the process's renewer (:mod:`celery_semaphore.core.heartbeat`) before
    the release, so a renewal racing an intentional release is never mistaken for a loss.
    The loss deadline is checked again when the block ends (a body that never yields the GIL
    can starve the renewer), and the release's own answer is consulted. A class rather than
    a generator: it wraps every bounded run, and is entered for a third of the cost.

    Args:
        slot (Slot | SlotGroup): a freshly acquired slot, or the slots of several keys
            (each renewed, all released); released on every path out of the block.
        interval (float | None): seconds between renewals; None for no renewal.
        on_renew_error: see :meth:`Semaphore.hold`.

    Raises:
        SemaphoreLeaseLostError: the block ended normally but the slot was lost meanwhile.
    """

    __slots__ = ("_beat", "interval", "on_renew_error", "slot")

    def __init__(
        self, slot: S, interval: float | None, on_renew_error: RenewErrorCallback | None = None
    ) -> None:
        self.slot = slot
        self.interval = interval
        self.on_renew_error = on_renew_error
        self._beat: Renewer | None = None

    def _members(self) -> tuple[Slot, ...]:
        slot = self.slot
        return slot.slots if isinstance(slot, SlotGroup) else (slot,)

    def __enter__(self) -> S:
        if self.interval is not None:
            beat = renewer()
            for member in self._members():
                beat.add(member, self.interval, self.on_renew_error)
            self._beat = beat
        return self.slot

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        slot = self.slot
        if self._beat is not None:
            for member in self._members():
                self._beat.remove(member)
        slot._check_deadline()
        try:
            slot.__exit__(exc_type, exc, tb)  # a release, or a back-off
        except Exception:
            # The lease runs out by itself; a failed release must not mask the body's outcome.
            logger.warning("could not release slot of semaphore %r", slot.key, exc_info=True)
        if exc_type is None and slot.lost.is_set():
            raise slot.lease_lost_error()
