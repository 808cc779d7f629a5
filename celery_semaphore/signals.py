"""The semaphore's Celery signals, at the import path the docs give them.

They live in :mod:`celery_semaphore.integration.signals`; see there for each signal's
arguments.
"""

from .integration.signals import (
    semaphore_acquired,
    semaphore_backed_off,
    semaphore_lease_lost,
    semaphore_parked,
    semaphore_refused,
    semaphore_released,
    semaphore_renew_failed,
    semaphore_shed,
)

__all__ = [
    "semaphore_acquired",
    "semaphore_backed_off",
    "semaphore_lease_lost",
    "semaphore_parked",
    "semaphore_refused",
    "semaphore_released",
    "semaphore_renew_failed",
    "semaphore_shed",
]
