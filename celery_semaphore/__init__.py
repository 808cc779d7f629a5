"""celery-semaphore: cap how many Celery tasks run at once across every worker.

A leased counting semaphore in Redis, and the Celery glue that puts one in front of a task.
"""

from .errors import (
    SemaphoreBackendError,
    SemaphoreError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from .semaphore import Holder, Semaphore, Slot

__all__ = [
    "Holder",
    "Semaphore",
    "SemaphoreBackendError",
    "SemaphoreError",
    "SemaphoreLeaseLostError",
    "SemaphoreNotAcquiredError",
    "SemaphoreValidationError",
    "Slot",
]
