"""The operator's side of the semaphores, from asyncio code: :class:`AsyncSemaphoreAdmin`,
the twin of :class:`~celery_semaphore.core.admin.SemaphoreAdmin`.

Every decision is its twin's: the checks, the calls and what their replies mean come from
:class:`~celery_semaphore.core.admin.AdminTrips`, and live limits are read with the same
helpers (:mod:`celery_semaphore.core.live`); this class only does the I/O, on the event
loop. So a limit set or a slot freed from a coroutine acts on every task and thread of the
key, and the other way round.
"""

from __future__ import annotations

import time

import redis
from redis.asyncio import RedisCluster as AsyncRedisCluster

from ..core import validation as check
from ..core.admin import (
    DEFAULT_PREFIX,
    A,
    AdminTrips,
    Holder,
    KeyScan,
    R,
    RoundTrip,
    eviction_warnings,
)
from ..core.handoff import DEFAULT_CLAIM_TIMEOUT, HandoffRoute
from ..core.live import (
    Feedback,
    LiveLimit,
    Pause,
    feedback_of,
    live_limit_of,
    pause_of,
    text_of,
)
from ..core.names import Namespace
from ..core.process import holder_member, member_pattern
from ..core.rates import Rate
from ..core.scripts import REDIS_ERRORS, AsyncScripts, backend_error, backend_errors
from .clients import AsyncClient
from .slot import deliver, recover_later


class AsyncSemaphoreAdmin(AdminTrips):
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

    async def _make(self, trip: RoundTrip[R, A]) -> A:  # see RoundTrip: SemaphoreAdmin's, awaited
        sent_at = time.monotonic()
        try:
            if trip.before:
                await self.client.zadd(self.names.room_index, trip.before, xx=True, lt=True)
            reply = await self._scripts.run(trip.call)
            if trip.after:
                await self.client.zadd(self.names.room_index, trip.after, xx=True)
            if trip.decision:
                await self.client.hset(f"{self.prefix}:decisions", *trip.decision)
        except REDIS_ERRORS as exc:
            if trip.token is not None:
                recover_later(self._scripts, self.keys_of(trip.key), trip.key, trip.token,
                              self.handoffs, sent_at, exc)  # fmt: skip
            raise backend_error(exc, trip.key, trip.limit) from exc
        answer, handed = trip.read(reply)
        await deliver(self.handoffs, trip.key, handed, self._scripts)
        return answer

    async def holders(self, key: str) -> list[Holder]:
        """Every live holder of ``key``, soonest expiry first (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        return await self._make(self._holders_trip(key))

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
        key, token = check.check_key(key), check.check_key(token, "token")
        with backend_errors(key):  # the views show a token; the store may know a member
            found = self.client.zscan_iter(self.keys_of(key).slots, match=member_pattern(token))
            member = holder_member(token, [text_of(member) async for member, _ in found])
        return await self._make(self._release_trip(key, member))

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
        return await self._make(self._release_all_trip(key))

    async def set_rate(
        self, key: str, rate: str | float | Rate | None, *, name: str = "requests",
        by: str | None = None,
    ) -> str | None:  # fmt: skip
        """Set (or, with None, clear) the live start rate ``name`` of ``key``: the asyncio
        twin of :meth:`SemaphoreAdmin.set_rate`, with its arguments, answer and errors."""
        return await self._make(self._rate_trip(key, rate, name, by))

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
        return await self._make(self._limit_trip(key, limit, by))

    async def pause(self, key: str, by: str | None = None) -> bool:
        """Pause ``key`` for the whole fleet: the asyncio twin of
        :meth:`SemaphoreAdmin.pause <celery_semaphore.core.admin.SemaphoreAdmin.pause>`, with
        its arguments, answer and errors (sync callers see the pause at once)."""
        return await self._make(self._pause_trip(key, True, by))

    async def resume(self, key: str, by: str | None = None) -> bool:
        """Resume ``key``: the asyncio twin of
        :meth:`SemaphoreAdmin.resume <celery_semaphore.core.admin.SemaphoreAdmin.resume>`;
        the hand-offs it makes are published in a worker thread."""
        return await self._make(self._pause_trip(key, False, by))

    async def feedback(self, key: str) -> Feedback | None:
        """What the provider's answers decided for ``key`` (its adaptive limit, its
        cool-down, its back-offs), or None when they decided nothing yet (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(key):
            return feedback_of(await self.client.hgetall(self.keys_of(check.check_key(key)).limits))

    async def pause_of(self, key: str) -> Pause | None:
        """Whether ``key`` is paused: who paused it and when, or None (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(key):
            return pause_of(await self.client.hgetall(self.keys_of(check.check_key(key)).limits))

    async def live_limit(self, key: str) -> LiveLimit | None:
        """The live limit of ``key`` (its ``limit``, ``set_at`` in epoch seconds by the Redis
        clock, and ``by``), or None when none is set. One round trip.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(key):
            return live_limit_of(
                await self.client.hgetall(self.keys_of(check.check_key(key)).limits)
            )

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
