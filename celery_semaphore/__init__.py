"""celery-semaphore: cap how many Celery tasks run at once across every worker.

A leased counting semaphore in Redis (:class:`Semaphore`), and the Celery glue that puts one
in front of a task (:class:`SemaphoreTask`, :func:`bounded`).
"""

# Imported for their effects: the worker-side signal handlers and the inspect command.
from . import control as _control  # noqa: F401
from . import worker as _worker  # noqa: F401
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
