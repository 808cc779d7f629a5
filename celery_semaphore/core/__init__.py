"""The lease algorithm: a counting semaphore in Redis whose slots are held by leases.

Nothing here imports Celery. The layers, bottom up: ``validation`` and ``options`` (argument
checks), ``clients`` (redis-py clients from URLs), ``names``, ``calls``, ``replies``,
``scripts`` and ``lua/`` (one atomic script per operation), ``slot`` (a held lease),
``heartbeat`` (renewal), ``admin`` (holders, force release and live limits, without a
limit), ``feedback`` (back-offs and adaptive limits), ``handoff``, ``room`` and
``room_reads`` (the waiting room), ``semaphore`` (acquire, hold, run, acquire's wait for a
release, and ``guard``: a slot held for a block), ``tracing``.
"""

from .admin import DEFAULT_PREFIX, Holder, SemaphoreAdmin
from .clients import client_from_url
from .feedback import Adaptive, BackOff
from .handoff import HandoffRoute
from .rates import Rate
from .room import WaitingRoom
from .semaphore import DEFAULT_LEASE, Semaphore, guard
from .slot import Slot

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_PREFIX",
    "Adaptive",
    "BackOff",
    "HandoffRoute",
    "Holder",
    "Rate",
    "Semaphore",
    "SemaphoreAdmin",
    "Slot",
    "WaitingRoom",
    "client_from_url",
    "guard",
]
