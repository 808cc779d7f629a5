"""Several keys at once from asyncio code: the ``acquire_many`` and ``hold_many`` methods of
:class:`~celery_semaphore.asyncio.AsyncSemaphore`.

The asyncio twin of :class:`celery_semaphore.core.group.ManyKeys`: the arguments are checked
and the call planned by the same :func:`~celery_semaphore.core.options.many_plan`, a cluster
misfit is refused by the same
:func:`~celery_semaphore.core.admin.many_redis_keys`, and the keys are taken by the same
acquire_many.lua, all of them in one script call or none. What is asyncio's own is the
cancellation safety of :meth:`Acquirer.taking <celery_semaphore.asyncio.acquiring.Acquirer.taking>`
(a cancelled acquire gives back every key it took) and renewal by the loop's renewer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from ..core.admin import many_redis_keys
from ..core.lease import RenewErrorCallback
from ..core.options import hold_interval, many_args, many_plan
from ..core.scripts import Keys, acquire_many_call
from ..core.tracing import acquire_span
from ..errors import SemaphoreNotAcquiredError
from .acquiring import Acquirer
from .group import AsyncSlotGroup
from .guard import check_interrupt, guard

KeyList = Sequence[tuple[str, int] | tuple[str, int, int]]
"""``(key, limit)`` or ``(key, limit, weight)`` of each key."""


class AsyncManyKeys:
    """The several-keys methods of :class:`~celery_semaphore.asyncio.AsyncSemaphore`.

    The attributes below are the semaphore's own, declared here so that these methods
    type-check on their own.
    """

    lease: float
    prefix: str
    _cluster: bool
    _acquirer: Acquirer

    def _keys_of_many(self, keys: list[str]) -> list[Keys]:
        return many_redis_keys(self.prefix, keys, self._cluster)

    async def acquire_many(
        self,
        keys: KeyList,
        *,
        lease: float | None = None,
        retries: int = 0,
        retry_delay: float = 0.1,
        metadata: Mapping[str, Any] | None = None,
    ) -> AsyncSlotGroup | None:
        """Take a slot of every key, all in one script call or none, as
        :meth:`Semaphore.acquire_many <celery_semaphore.core.group.ManyKeys.acquire_many>`
        does, on the same keys: a caller bounded at several levels (the provider's limit and
        a tenant's) never holds one slot while it waits for another.

        Cancelling the call never leaves a slot held: if its script reaches Redis, every
        slot it took is given back as soon as the answer is in.

        Args:
            keys (Sequence[tuple[str, int] | tuple[str, int, int]]): ``(key, limit)`` or
                ``(key, limit, weight)`` for each key, at least one, no key twice: each key's
                own limit for this call (a live limit set on a key wins over it) and the
                units of it the call takes (default 1, at most the limit). On Redis Cluster
                the keys must share a hash tag (``"{llm}openai"``, ``"{llm}tenant:acme"``).
            lease (float | None): as for :meth:`AsyncSemaphore.acquire`, for every slot.
            retries (int): further attempts when some key has no room. 0 (the default)
                fails fast. A bounded spin: no release wakes a caller for keys it does not
                hold, so there is no ``wait``.
            retry_delay (float): as for :meth:`AsyncSemaphore.acquire`.
            metadata (Mapping[str, Any] | None): as for :meth:`AsyncSemaphore.acquire`,
                stored with each key's slot.

        Returns:
            AsyncSlotGroup | None: the slots, which the caller must release (one round trip
            per key); None if every attempt found some key without room (or was answered
            only after a whole lease, when the slots it won are given back at once).

        Raises:
            SemaphoreValidationError: an argument is invalid, a key is given twice, or on a
                cluster the keys share no hash slot (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        acquirer = self._acquirer
        plan = many_plan(keys, lease, self.lease, retries, retry_delay, metadata,
                         acquirer.metadata, self._keys_of_many)  # fmt: skip
        held = list(zip(plan.keys, plan.names, strict=True))
        call = acquire_many_call(plan.groups, plan.ms, plan.token, plan.info)
        with acquire_span(plan.label, plan.limit, plan.names) as record:
            for attempt in range(plan.attempts):
                if attempt:
                    await asyncio.sleep(plan.delay)
                sent_at = time.monotonic()
                reply = await acquirer.taking(call, plan.label, plan.token, held)
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

    @contextlib.asynccontextmanager
    async def hold_many(
        self,
        keys: KeyList,
        *,
        retries: int = 0,
        retry_delay: float = 0.1,
        lease: float | None = None,
        heartbeat: float | bool | None = None,
        on_renew_error: RenewErrorCallback | None = None,
        metadata: Mapping[str, Any] | None = None,
        interrupt: bool = False,
    ) -> AsyncIterator[AsyncSlotGroup]:
        """Hold a slot of every key for the ``async with`` block, renewing them all in the
        background: the loop's renewer renews them with its other slots, in one round trip
        per tick (per hash slot on a cluster, which a group's keys share).

        Args:
            keys: as for :meth:`acquire_many`.
            retries (int): as for :meth:`acquire_many`.
            retry_delay (float): as for :meth:`acquire_many`.
            lease (float | None): as for :meth:`acquire_many`.
            heartbeat (float | bool | None): as for :meth:`AsyncSemaphore.hold`.
            on_renew_error (Callable[[BaseException], object] | None): as for
                :meth:`AsyncSemaphore.hold`.
            metadata (Mapping[str, Any] | None): as for :meth:`acquire_many`.
            interrupt (bool): cancel the task running the block the moment any of the slots
                is lost. Default False: the block runs on, and can watch ``group.lost``.

        Yields:
            AsyncSlotGroup: the held slots. ``group.lost`` is set the moment any is known
            gone.

        Raises:
            SemaphoreValidationError: an argument is invalid (checked before acquiring).
            SemaphoreNotAcquiredError: every attempt found some key without room.
            SemaphoreLeaseLostError: a slot was lost while the block ran (its key is named),
                even if the block itself succeeded, or it was cancelled by ``interrupt``. If
                the block raised, its exception propagates instead.
            SemaphoreBackendError: Redis failed while acquiring.
        """
        interval = hold_interval(lease, self.lease, heartbeat, on_renew_error)
        check_interrupt(interrupt)
        group = await self.acquire_many(
            keys, lease=lease, retries=retries, retry_delay=retry_delay, metadata=metadata
        )
        if group is None:
            specs = many_args(keys)
            label = "+".join(key for key, _, _ in specs)
            raise SemaphoreNotAcquiredError(
                f"semaphore {label!r}: not every key had room, so none was taken", label,
                specs[0][1],
            )  # fmt: skip
        async with guard(group, interval, on_renew_error, interrupt):
            yield group
