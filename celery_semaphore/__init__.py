"""celery-semaphore: cap how many Celery tasks run at once across every worker.

A leased counting semaphore in Redis (:class:`Semaphore`, in :mod:`celery_semaphore.core`),
and the Celery glue that puts one in front of a task (:class:`SemaphoreTask`,
:func:`bounded`, in :mod:`celery_semaphore.integration`).

The Celery names are imported on first use, so ``from celery_semaphore import Semaphore``
imports neither Celery nor the glue's worker hooks.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from .core import Adaptive, BackOff, Holder, Rate, Semaphore, SemaphoreAdmin, Slot, WaitingRoom
from .errors import (
    LeaseInterrupted,
    Refusal,
    SemaphoreBackendError,
    SemaphoreError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreRunLostError,
    SemaphoreValidationError,
)

if TYPE_CHECKING:
    from .integration import SemaphoreTask, bounded, current_slot

__version__ = version("celery-semaphore")  # CHANGELOG.md says what each version changed

_GLUE = frozenset({"SemaphoreTask", "bounded", "current_slot"})


def __getattr__(name: str) -> Any:
    if name in _GLUE:
        return getattr(importlib.import_module(".integration", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Adaptive",
    "BackOff",
    "Holder",
    "LeaseInterrupted",
    "Rate",
    "Refusal",
    "Semaphore",
    "SemaphoreAdmin",
    "SemaphoreBackendError",
    "SemaphoreError",
    "SemaphoreLeaseLostError",
    "SemaphoreNotAcquiredError",
    "SemaphoreRunLostError",
    "SemaphoreTask",
    "SemaphoreValidationError",
    "Slot",
    "WaitingRoom",
    "bounded",
    "current_slot",
]
