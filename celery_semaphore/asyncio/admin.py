"""The operator's side of the semaphores, from asyncio code: :class:`AsyncSemaphoreAdmin`,
the twin of :class:`~celery_semaphore.core.admin.SemaphoreAdmin`.

It sends the same scripts through the same call builders (:mod:`celery_semaphore.core.calls`)
and reads live limits with the same helpers (:mod:`celery_semaphore.core.live`), so a limit
set or a slot freed from a coroutine acts on every task and thread of the key, and the other
way round.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import redis
from redis.asyncio import RedisCluster as AsyncRedisCluster

from ..core import validation as check
from ..core.admin import DEFAULT_PREFIX, Holder, KeyScan, eviction_warnings, holder_from_reply
from ..core.calls import (
    Call,
    force_release_all_call,
    holders_call,
    pause_call,
    release_call,
    set_limit_call,
)
from ..core.handoff import DEFAULT_CLAIM_TIMEOUT, HandoffRoute
from ..core.live import (
    LiveLimit,
    Pause,
    limit_change,
    live_limit_of,
    log_limit_change,
    log_pause_change,
    pause_change,
    pause_of,
    text_of,
)
from ..core.live_rates import log_rate_change, rate_change, set_rate_call
from ..core.names import Keys, Namespace
from ..core.process import holder_member, member_pattern, token_of
from ..core.rates import Rate
from ..core.scripts import AsyncScripts, backend_errors
from .clients import AsyncClient
from .slot import deliver

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncSemaphoreAdmin:
    """Read and free the slots of every semaphore under ``prefix``, and set their live limits,
    from asyncio code, whatever their limit.

    Args:
        client (redis.asyncio.Redis | redis.asyncio.RedisCluster): where the semaphores live.
        prefix (str): their key namespace (default ``"semaphore"``).
        handoffs (HandoffRoute | None): where the slots a force release or a raised limit
            hands to parked waiters go; None: nowhere (a sweep hands them out again).
        scripts (AsyncScripts | None): the registered scripts to send through (an
            :class:`~celery_semaphore.asyncio.AsyncSemaphore` shares its own); None: its own.

    Raises:
        SemaphoreValidationError: ``prefix`` is not a non-empty str.
    """

    def __init__(
        self,
        client: AsyncClient,
        prefix: str = DEFAULT_PREFIX,
        handoffs: HandoffRoute | None = None,
        scripts: AsyncScripts | None = None,
    ) -> None:
        self.client = client
        self.prefix = check.check_key(prefix, "prefix")
        self.names = Namespace(self.prefix, isinstance(client, AsyncRedisCluster))
        self.handoffs = handoffs or HandoffRoute(DEFAULT_CLAIM_TIMEOUT, None)
        self._scripts = scripts or AsyncScripts(client)

    def keys_of(self, key: str) -> Keys:
        """The Redis keys of ``key`` (see :meth:`Namespace.keys_of`).

        Raises:
            SemaphoreValidationError: ``key`` starts with ``}`` and the client is a cluster's.
        """
        return self.names.keys_of(key)

    async def _run(self, key: str, call: Call[T]) -> T:
        with backend_errors(key):
            return await self._scripts.run(call)

    async def holders(self, key: str) -> list[Holder]:
        """Every live holder of ``key``, soonest expiry first (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        now_ms, rows = await self._run(key, holders_call(self.keys_of(key)))
        return [holder_from_reply(t, expires, info, now_ms) for t, expires, info in rows]

    async def force_release(self, key: str, token: str) -> bool:
        """Free one holder's slot by its token (from :meth:`holders`), as an operator would;
        see :meth:`SemaphoreAdmin.force_release
        <celery_semaphore.core.admin.SemaphoreAdmin.force_release>`.

        Returns:
            bool: True when that holder was live until now.

        Raises:
            SemaphoreValidationError: ``key`` or ``token`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        check.check_key(token, "token")
        keys = self.keys_of(key)
        with backend_errors(key):  # the views show a token; the store may know a member
            found = self.client.zscan_iter(keys.slots, match=member_pattern(token))
            token = holder_member(token, [text_of(member) async for member, _ in found])
        call = release_call(keys, token, self.handoffs.release_claim_ms, None)
        await self._bring_on(keys, key)
        live, handed = await self._run(key, call)
        await deliver(self.handoffs, key, handed, self._scripts)
        if live:
            logger.warning("semaphore %r: holder %s force-released", key, token_of(token))
        return live

    async def force_release_all(self, key: str) -> int:
        """Free every slot of ``key`` at once (an operator's recovery tool).

        The displaced holders keep running; each learns of it at its next renewal or release,
        which answers "gone" (so a ``hold`` raises :class:`SemaphoreLeaseLostError`).

        Returns:
            int: how many live holders were displaced.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        await self._bring_on(self.keys_of(key), key)
        displaced = await self._run(key, force_release_all_call(self.keys_of(key)))
        with backend_errors(key):  # the freed slots wait for the room's next sweep: now
            await self.client.zadd(self.names.room_index, {key: 0}, xx=True)
        logger.warning(
            "semaphore %r: every slot force-released, %d live holder(s) displaced", key, displaced
        )
        return displaced

    async def set_rate(
        self, key: str, rate: str | float | Rate | None, *, name: str = "requests",
        by: str | None = None,
    ) -> str | None:  # fmt: skip
        """Set (or, with None, clear) the live start rate ``name`` of ``key``: the asyncio
        twin of :meth:`SemaphoreAdmin.set_rate`, with its arguments, answer and errors."""
        key, new, who = rate_change(key, rate, name, by)
        name = name if new is None else new.name
        previous, _ = await self._run(key, set_rate_call(self.keys_of(key), name, new, who))
        log_rate_change(key, name, new, previous, who)
        return previous

    async def set_limit(self, key: str, limit: int | None, by: str | None = None) -> int | None:
        """Set the live limit of ``key``, which wins over the limit every caller gives
        (coroutines, threads and tasks alike) until it is cleared; None clears it. One round
        trip; the change is logged at WARNING by ``celery_semaphore.core.live``, naming who.

        Lowering it evicts no holder: new ones are refused until the key is under it.
        Raising it hands the new capacity to the oldest parked runs in the same script call
        (published through the hand-off route, in a worker thread) and wakes callers waiting
        in ``acquire(wait=...)``, sync or asyncio.

        Args:
            key (str): the semaphore's key.
            limit (int | None): its new live limit (1 to 2**31 - 1); None clears it.
            by (str | None): who sets it, for the views; None: ``user@host pid N``.

        Returns:
            int | None: the live limit it replaced (None: there was none).

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        key, limit, who = limit_change(key, limit, by)
        call = set_limit_call(self.keys_of(key), limit, who, self.handoffs.release_claim_ms)
        await self._bring_on(self.keys_of(key), key)
        previous, _, handed = await self._run(key, call)
        await deliver(self.handoffs, key, handed, self._scripts)
        log_limit_change(key, limit, previous, who)
        return previous

    async def pause(self, key: str, by: str | None = None) -> bool:
        """Pause ``key`` for the whole fleet: the asyncio twin of
        :meth:`SemaphoreAdmin.pause <celery_semaphore.core.admin.SemaphoreAdmin.pause>`, with
        its arguments, answer and errors (sync callers see the pause at once)."""
        return await self._pause(key, True, by)

    async def resume(self, key: str, by: str | None = None) -> bool:
        """Resume ``key``: the asyncio twin of
        :meth:`SemaphoreAdmin.resume <celery_semaphore.core.admin.SemaphoreAdmin.resume>`;
        the hand-offs it makes are published in a worker thread."""
        return await self._pause(key, False, by)

    async def _pause(self, key: str, paused: bool, by: str | None) -> bool:
        key, who = pause_change(key, by)
        call = pause_call(self.keys_of(key), paused, who, self.handoffs.release_claim_ms)
        await self._bring_on(self.keys_of(key), key)
        was, handed = await self._run(key, call)
        await deliver(self.handoffs, key, handed, self._scripts)
        log_pause_change(key, paused, was, who)
        return was

    async def _bring_on(self, keys: Keys, key: str) -> None:
        """Before a change that may free slots of ``key``: see
        :meth:`~celery_semaphore.core.handoff.HandoffRoute.mark_before`."""
        index, mark = self.handoffs.mark_before(keys, key)
        with backend_errors(key):
            await self.client.zadd(index, mark, xx=True, lt=True)

    async def pause_of(self, key: str) -> Pause | None:
        """Whether ``key`` is paused: who paused it and when, or None (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        keys = self.keys_of(check.check_key(key))
        with backend_errors(key):
            return pause_of(await self.client.hgetall(keys.limits))

    async def live_limit(self, key: str) -> LiveLimit | None:
        """The live limit of ``key`` (its ``limit``, ``set_at`` in epoch seconds by the Redis
        clock, and ``by``), or None when none is set. One round trip.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        keys = self.keys_of(check.check_key(key))
        with backend_errors(key):
            return live_limit_of(await self.client.hgetall(keys.limits))

    async def scan_keys(
        self, limit: int = 10_000, rooms: bool = False, limits: bool = False
    ) -> list[str]:
        """The keys of every semaphore under the prefix, sorted: the asyncio twin of
        :meth:`SemaphoreAdmin.scan_keys`, with the arguments of
        :class:`~celery_semaphore.core.admin.KeyScan`.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        scan = KeyScan(self.prefix, limit, rooms, limits)
        with backend_errors(f"{self.prefix}:*"):
            async for raw in self.client.scan_iter(match=scan.match, count=500, _type=scan.kind):
                if scan.enough(raw):
                    break
        return sorted(scan.found)

    async def server_warnings(self) -> list[str]:
        """What about the server could break the semaphore's promise: the asyncio twin of
        :meth:`SemaphoreAdmin.server_warnings`, with its answer."""
        try:
            return eviction_warnings(await self.client.config_get("maxmemory-policy"))
        except redis.RedisError:
            return []
