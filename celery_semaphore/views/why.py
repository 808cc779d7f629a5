"""Why is a task waiting: where a run stands in the waiting rooms, read from Redis (see
:func:`~celery_semaphore.core.room_reads.standings`: every room the room index lists is looked
at, about R / 500 round trips for R rooms, never a ``KEYS``; a run found in no room may hold a
slot, and the keys with holders are then read).
"""

from __future__ import annotations

import redis

from ..core import validation as check
from ..core.admin import DEFAULT_PREFIX, SemaphoreAdmin
from ..core.room_reads import Standing as Standing
from ..core.room_reads import standings
from ..core.scripts import backend_errors


def why(client: redis.Redis, task_id: str, prefix: str = DEFAULT_PREFIX) -> list[Standing]:
    """Where run ``task_id`` stands: one :class:`Standing` per room it waits in (a run of
    several keys waits in each) or per key whose slot it holds; empty when it is in none.

    Raises:
        SemaphoreValidationError: ``task_id`` is not a non-empty str (nothing is read).
        SemaphoreBackendError: Redis failed.
    """
    task_id = check.check_key(task_id, "task_id")
    with backend_errors(task_id):
        return standings(SemaphoreAdmin(client, prefix), task_id)
