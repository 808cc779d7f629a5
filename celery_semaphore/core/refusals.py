"""The :class:`~celery_semaphore.errors.SemaphoreNotAcquiredError` of a call that got no slot,
with the :class:`~celery_semaphore.errors.Refusal` that says why, the same for the sync and
the asyncio semaphore and for the Celery glue."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import Refusal, SemaphoreError, SemaphoreNotAcquiredError

if TYPE_CHECKING:
    from ..asyncio.admin import AsyncSemaphoreAdmin
    from .admin import SemaphoreAdmin


def is_paused(admin: SemaphoreAdmin, key: str) -> bool:
    """Whether an operator paused ``key``: asked only once a call was refused, to tell why
    (one round trip; False if the store cannot say)."""
    try:
        return admin.pause_of(key) is not None
    except SemaphoreError:
        return False


async def is_paused_async(admin: AsyncSemaphoreAdmin, key: str) -> bool:
    """:func:`is_paused` for the asyncio admin."""
    try:
        return await admin.pause_of(key) is not None
    except SemaphoreError:
        return False


def not_acquired(
    key: str, limit: int | None, wait: float = 0.0, closed: bool = False, paused: bool = False
) -> SemaphoreNotAcquiredError:
    """The error of a call for ``key`` (of ``limit``) that got no slot.

    Args:
        key (str): the key, or the keys joined with ``+``.
        limit (int | None): its limit.
        wait (float): seconds the call was allowed to wait for a release; 0: it only tried
            (its retries, if any).
        closed (bool): the semaphore was closed while the call waited.
        paused (bool): an operator paused the key (see :func:`is_paused`).

    Returns:
        SemaphoreNotAcquiredError: ``SHUTDOWN`` when closed, ``PAUSED`` when paused,
        ``TIMEOUT`` after a wait, else ``FULL``.
    """
    if paused and not closed:
        return SemaphoreNotAcquiredError(
            f"semaphore {key!r} is paused: nothing new starts until it is resumed", key, limit,
            Refusal.PAUSED,
        )  # fmt: skip
    if closed:
        return SemaphoreNotAcquiredError(
            f"semaphore {key!r}: closed while waiting for a slot", key, limit, Refusal.SHUTDOWN
        )
    if wait > 0:
        return SemaphoreNotAcquiredError(
            f"semaphore {key!r} had all {limit} slots held for {wait:g}s", key, limit,
            Refusal.TIMEOUT,
        )  # fmt: skip
    return SemaphoreNotAcquiredError(
        f"semaphore {key!r} has all {limit} slots held", key, limit, Refusal.FULL
    )
