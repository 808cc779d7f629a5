"""What is running now: the slot of the bounded body in this thread, and the switch that
runs bodies unbounded in tests (see :func:`celery_semaphore.testing.unbounded`)."""

from __future__ import annotations

import contextvars
import threading

from ..core.group import SlotGroup
from ..core.slot import Slot

CURRENT: contextvars.ContextVar[Slot | SlotGroup | None] = contextvars.ContextVar(
    "celery_semaphore_current_slot", default=None
)
"""The slot of the bounded body running in this context (set by the runner)."""


class _Switch:
    """A process-wide on/off switch that blocks can nest (see ``testing.unbounded``)."""

    def __init__(self) -> None:
        self._depth = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1

    def __bool__(self) -> bool:
        return self._depth > 0


UNBOUNDED = _Switch()
"""On while :func:`celery_semaphore.testing.unbounded` is entered: bodies run with no slot."""


def current_slot() -> Slot | SlotGroup | None:
    """The slot held by the bounded task (or function) running in this thread, or None; for
    a task that holds several keys, their :class:`~celery_semaphore.core.group.SlotGroup`.

    Long bodies can watch ``current_slot().lost`` to stop early when the slot is gone.
    """
    return CURRENT.get()
