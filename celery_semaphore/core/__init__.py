"""The lease algorithm: a counting semaphore in Redis whose slots are held by leases.

Nothing here imports Celery. The layers, bottom up: ``validation`` (argument checks),
``clients`` (redis-py clients from URLs), ``scripts``, ``calls``, ``names`` and ``lua/`` (one
atomic script per operation), ``slot`` (a held lease), ``heartbeat`` (renewal), ``guard``
(a slot held for a block), ``semaphore`` (acquire, hold, run), ``admin`` (holders and force
release without a limit), ``tracing``.
"""

from .admin import DEFAULT_PREFIX, Holder, SemaphoreAdmin
from .clients import client_from_url
from .semaphore import DEFAULT_LEASE, Semaphore, guard
from .slot import Slot

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_PREFIX",
    "Holder",
    "Semaphore",
    "SemaphoreAdmin",
    "Slot",
    "client_from_url",
    "guard",
]
