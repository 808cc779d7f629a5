"""Several keys at once from asyncio code: the round trips behind
:meth:`AsyncSemaphore.acquire_many <celery_semaphore.asyncio.AsyncSemaphore.acquire_many>`.

The asyncio twin of :func:`celery_semaphore.core.group.take_group`: the arguments are checked
and the call planned by the same :meth:`~celery_semaphore.core.options.Planner.many`, a cluster
misfit is refused by the same :func:`~celery_semaphore.core.names.many_redis_keys`, and the
keys are taken by the same acquire_many.lua, all of them in one script call or none. What
is asyncio's own is the cancellation safety of
:meth:`Acquirer.taking <celery_semaphore.asyncio.acquiring.Acquirer.taking>` (a cancelled
acquire gives back every key it took) and renewal by the loop's renewer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from ..core.options import ManyPlan
from ..core.tracing import acquire_span
from .acquiring import Acquirer
from .group import AsyncSlotGroup

KeyList = Sequence[tuple[str, int] | tuple[str, int, int]]
"""``(key, limit)`` or ``(key, limit, weight)`` of each key."""


async def take_group(acquirer: Acquirer, plan: ManyPlan) -> AsyncSlotGroup | None:
    """Take a slot of every key of ``plan`` in one script call, or none, attempt after
    attempt as ``plan`` says (see :meth:`AsyncSemaphore.acquire_many
    <celery_semaphore.asyncio.AsyncSemaphore.acquire_many>`): the group, or None when every
    attempt found some key without room.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    held = list(zip(plan.keys, plan.names, strict=True))
    with acquire_span(plan.label, plan.limit, plan.names) as record:
        for attempt in range(plan.attempts):
            if attempt:
                await asyncio.sleep(plan.delay)
            sent_at = time.monotonic()
            reply = await acquirer.taking(plan.call, plan.label, plan.token, held)
            if not isinstance(reply, list):
                continue
            if time.monotonic() - sent_at < plan.seconds:
                record(attempt + 1, "acquired")
                return AsyncSlotGroup(
                    [acquirer.slot(k, key, plan.token, plan.seconds, admitted, sent_at, weight)
                     for k, key, admitted, weight in plan.members(reply)]
                )  # fmt: skip
            # Answered after a whole lease: the slots cannot be trusted to be ours.
            await acquirer.background.finish(acquirer.give_back_all(held, plan.token))
        record(plan.attempts, "full")
    return None
