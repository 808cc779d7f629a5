"""Live limits from asyncio code: the ``set_limit``, ``live_limit`` and ``available`` methods
of :class:`~celery_semaphore.asyncio.AsyncSemaphore`.

They read and write the same hash as :class:`~celery_semaphore.core.live.LiveLimits` (the
sync semaphore's and the CLI's), through the same script, with the same checks and the same
log line (see :func:`~celery_semaphore.core.live.limit_change`), so a limit set from a
coroutine applies to every task and thread of the key, and the other way round.
"""

from __future__ import annotations

from ..core import validation as check
from ..core.live import LiveLimit, limit_change, live_limit_of, log_limit_change
from ..core.room import HandoffRoute
from ..core.scripts import Keys, backend_errors, set_limit_call
from .acquiring import Acquirer
from .clients import AsyncClient
from .slot import deliver


class AsyncLiveLimits:
    """The live-limit methods of :class:`~celery_semaphore.asyncio.AsyncSemaphore`.

    The attributes and the two methods below are the semaphore's own, declared here so that
    these methods type-check on their own.
    """

    limit: int
    client: AsyncClient
    handoffs: HandoffRoute
    _acquirer: Acquirer

    def _redis_keys(self, key: str) -> Keys:
        raise NotImplementedError

    async def count(self, key: str) -> int:
        raise NotImplementedError

    async def set_limit(self, key: str, limit: int | None, by: str | None = None) -> int | None:
        """Set the live limit of ``key``, which wins over the limit every caller gives
        (coroutines, threads and tasks alike) until it is cleared; None clears it. One round
        trip; the change is logged at WARNING by ``celery_semaphore.core.live``, naming who.

        Lowering it evicts no holder: new ones are refused until the key is under it.
        Raising it hands the new capacity to the oldest parked Celery runs in the same script
        call (published through ``on_handoff``, in a worker thread) and wakes callers waiting
        in ``acquire(wait=...)``, sync or asyncio.

        Args:
            key (str): the semaphore's key.
            limit (int | None): its new live limit, as for :meth:`Semaphore.set_limit
                <celery_semaphore.core.semaphore.Semaphore.set_limit>`; None clears it.
            by (str | None): who sets it, for the views; None: ``user@host pid N``.

        Returns:
            int | None: the live limit it replaced (None: there was none).

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        key, limit, who = limit_change(key, limit, by)
        call = set_limit_call(self._redis_keys(key), limit, who, self.handoffs.release_claim_ms)
        previous, _, handed = await self._acquirer.run(key, call)
        await deliver(self.handoffs, key, handed)
        log_limit_change(key, limit, previous, who)
        return previous

    async def live_limit(self, key: str) -> LiveLimit | None:
        """The live limit of ``key`` (its ``limit``, ``set_at`` in epoch seconds by the Redis
        clock, and ``by``), or None when none is set. One round trip.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        keys = self._redis_keys(check.check_key(key))
        with backend_errors(key, self.limit):
            return live_limit_of(await self.client.hgetall(keys.limits))

    async def available(self, key: str, limit: int | None = None) -> int:
        """The units of ``key`` free now: its live limit if one is set, else ``limit``, else
        the semaphore's, minus the weights of its live holders; never below 0. Two round
        trips.

        Raises:
            SemaphoreValidationError: ``key`` or ``limit`` is invalid.
            SemaphoreBackendError: Redis failed.
        """
        own = self.limit if limit is None else check.check_limit(limit)
        live = await self.live_limit(key)
        return max(0, (own if live is None else live.limit) - await self.count(key))
