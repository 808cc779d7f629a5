"""The semaphore for asyncio code: the same slots, keys and scripts as the sync one.

:class:`AsyncSemaphore` (on ``redis.asyncio``) and the :class:`AsyncSlot` it hands out share
every Redis key and Lua script with :class:`celery_semaphore.Semaphore`, so coroutines, plain
threads and Celery tasks that name one key count against one limit. Nothing here imports
Celery; ``@bounded`` on an ``async def`` (in :mod:`celery_semaphore.integration`) builds on
it. See the asyncio how-to for a walk through.
"""

from .admin import AsyncSemaphoreAdmin
from .clients import async_client_from_url, async_client_like
from .group import AsyncSlotGroup
from .semaphore import AsyncSemaphore
from .slot import AsyncSlot

__all__ = [
    "AsyncSemaphore",
    "AsyncSemaphoreAdmin",
    "AsyncSlot",
    "AsyncSlotGroup",
    "async_client_from_url",
    "async_client_like",
]
