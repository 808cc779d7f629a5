"""celery-semaphore: cap how many Celery tasks run at once across every worker.

A leased counting semaphore in Redis (:class:`Semaphore`), and the Celery glue that puts one
in front of a task (:class:`SemaphoreTask`, :func:`bounded`).
"""

from . import worker as _worker  # noqa: F401  connects the worker-side signal handlers
from .bounded import current_slot
from .decorators import bounded
from .errors import (
    SemaphoreBackendError,
    SemaphoreError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from .semaphore import Holder, Semaphore, Slot
from .task import SemaphoreTask

__all__ = [
    "Holder",
    "Semaphore",
    "SemaphoreBackendError",
    "SemaphoreError",
    "SemaphoreLeaseLostError",
    "SemaphoreNotAcquiredError",
    "SemaphoreTask",
    "SemaphoreValidationError",
    "Slot",
    "bounded",
    "current_slot",
]
