"""What is running now: the slot of the bounded body in this thread, and the switch that
runs bodies unbounded in tests (see :func:`celery_semaphore.testing.unbounded`)."""

from __future__ import annotations

import contextvars

from ..core.group import SlotGroup
from ..core.slot import Slot

CURRENT: contextvars.ContextVar[Slot | SlotGroup | None] = contextvars.ContextVar(
    "celery_semaphore_current_slot", default=None
)
"""The slot of the bounded body running in this context (set by the runner)."""

UNBOUNDED: list[None] = []
"""Not empty while :func:`celery_semaphore.testing.unbounded` is entered, one entry per block
(so blocks nest, in any thread: ``append`` and ``pop`` are atomic): bodies run with no slot."""


def current_slot() -> Slot | SlotGroup | None:
    """The slot held by the bounded task (or function) running in this thread, or None; for
    a task that holds several keys, their :class:`~celery_semaphore.core.group.SlotGroup`.

    Long bodies can watch ``current_slot().lost`` to stop early when the slot is gone.
    """
    return CURRENT.get()
