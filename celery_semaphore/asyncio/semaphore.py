"""The leased counting semaphore for asyncio code, on ``redis.asyncio``.

:class:`AsyncSemaphore` takes the same options, uses the same Redis keys and runs the same
Lua scripts (:class:`~celery_semaphore.core.scripts.AsyncScripts`) as
:class:`~celery_semaphore.core.semaphore.Semaphore`, so coroutines and Celery tasks that
name the same key share its slots. What is asyncio's own: renewal by one task per event
loop (:mod:`.renewer`), an interrupt that cancels the body's task (:mod:`.guard`), and
cancellation safety: a cancelled acquire never leaves a slot held, a cancelled body gives
its slot back, and :meth:`AsyncSemaphore.aclose` gives back whatever is still held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from redis.asyncio import RedisCluster as AsyncRedisCluster

from ..core import validation as check
from ..core.admin import DEFAULT_PREFIX
from ..core.calls import count_call
from ..core.feedback import DEFAULT_MAX_COOL_DOWN, Adaptive
from ..core.group import group_refused
from ..core.handoff import DEFAULT_CLAIM_TIMEOUT, DEFAULT_HANDOFF_GRACE, HandoffRoute, Publisher
from ..core.lease import RenewErrorCallback
from ..core.names import Namespace
from ..core.options import DEFAULT_LEASE, KeySpecs, Planner, semaphore_options
from ..core.rates import RateSpec, rates_of
from ..core.refusals import is_paused_async, not_acquired
from ..core.replies import Admitted, Full
from ..core.scripts import AsyncScripts
from ..core.tracing import acquire_span
from .acquiring import Acquirer
from .admin import AsyncSemaphoreAdmin
from .clients import AsyncClient, async_client_of
from .group import AsyncSlotGroup, take_group
from .guard import guard
from .slot import AsyncSlot

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncSemaphore:
    """A counting semaphore in Redis whose slots are held by leases, for asyncio code.

    At most ``limit`` holders hold a slot of one key at once, across every process that uses
    the same Redis and prefix, whether they hold it through this class, through
    :class:`~celery_semaphore.Semaphore` or as a bounded Celery task.

    Args:
        redis (redis.asyncio.Redis | redis.asyncio.RedisCluster | str): a ``redis.asyncio``
            client (plain, Sentinel-managed or cluster), or a URL to make one from (see
            :func:`~celery_semaphore.asyncio.async_client_from_url`). A client made from a
            URL is closed by :meth:`aclose`; one passed in is left to its owner.
        limit (int | Adaptive): how many holders at once, per key. Required; >= 1. An
            :class:`~celery_semaphore.core.feedback.Adaptive` limit starts at its
            ``initial`` and then adapts to the provider's answers, fleet-wide.
        lease (float): default seconds a slot lives without an extend. Default 60.0.
        prefix (str): namespace of the Redis keys, ``<prefix>:{<key>}``. Default
            ``"semaphore"``; must be non-empty and free of braces.
        claim_timeout (float): seconds a slot that a release hands to a parked Celery run
            stays reserved for it. Default 30.0.
        on_handoff (Callable[[str, Sequence[Handoff]], object] | None): called, in a worker
            thread, with the key and the hand-offs whenever a release here reserves freed
            slots for parked runs: it must publish their payloads. None leaves them to the
            workers' sweep.
        handoff_grace (float): seconds a reservation is kept for its run alone. Default 1.0.
        rate (RateSpec): start rates of every key, as for :class:`Semaphore`. Default None.
        max_cool_down (float): seconds: the longest cool-down a back-off may ask for; a
            longer hint is clamped and logged. Default 300.0.

    Raises:
        SemaphoreValidationError: any argument is invalid (before any connection is made).

    Attributes:
        admin (AsyncSemaphoreAdmin): the operator's side of the same keys: holders, force
            release, live limits.
        handoffs (HandoffRoute): where the slots its calls reserve for parked runs go.

    Use it from one event loop: its client's connections and its slots belong to the loop
    they were first used in. It has no waiting room of its own: parked runs are Celery's
    (see :class:`~celery_semaphore.core.room.WaitingRoom`); a coroutine that must wait for a
    slot waits in :meth:`acquire` with ``wait=``.

    Example::

        sem = AsyncSemaphore("redis://localhost:6379/0", limit=20)
        async with sem.hold("openai") as slot:
            await call_model(prompt)
    """

    def __init__(
        self,
        redis: AsyncClient | str,
        limit: int | Adaptive,
        lease: float = DEFAULT_LEASE,
        prefix: str = DEFAULT_PREFIX,
        claim_timeout: float = DEFAULT_CLAIM_TIMEOUT,
        on_handoff: Publisher | None = None,
        handoff_grace: float = DEFAULT_HANDOFF_GRACE,
        rate: RateSpec = None,
        max_cool_down: float = DEFAULT_MAX_COOL_DOWN,
    ) -> None:
        self.limit, self.lease, self.prefix = semaphore_options(limit, lease, prefix)
        adaptive = limit if isinstance(limit, Adaptive) else None
        self.handoffs = HandoffRoute(claim_timeout, on_handoff, handoff_grace, adaptive,
                                     max_cool_down)  # fmt: skip
        self.rates = rates_of(rate)
        self.client = client = async_client_of(redis)
        self._owns_client = isinstance(redis, str)
        self.names = Namespace(self.prefix, isinstance(client, AsyncRedisCluster))
        scripts = AsyncScripts(client)
        self._acquirer = Acquirer(scripts, self.limit, self.handoffs)
        self._plan = Planner(self.limit, self.lease, self.rates, self.names,
                             AsyncSemaphore.acquire.__kwdefaults__)  # fmt: skip
        self.admin = AsyncSemaphoreAdmin(client, self.prefix, self.handoffs, scripts)

    def __repr__(self) -> str:
        return f"<AsyncSemaphore prefix={self.prefix!r} limit={self.limit} lease={self.lease:g}s>"

    async def __aenter__(self) -> AsyncSemaphore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def acquire(
        self,
        key: str,
        *,
        limit: int | None = None,
        weight: int = 1,
        lease: float | None = None,
        retries: int = 0,
        retry_delay: float = 0.1,
        metadata: Mapping[str, Any] | None = None,
        wait: float = 0.0,
        units: Mapping[str, int] | None = None,
    ) -> AsyncSlot | None:
        """Take a slot of ``key`` (one round trip per attempt), or None when all are held.

        Cancelling the call never leaves a slot held: if its acquire reaches Redis, the slot
        it took is given back as soon as the answer is in.

        Args:
            key (str): the semaphore's key; any non-empty str.
            limit (int | None): this call's limit for ``key``; None: the semaphore's. A live
                limit set on the key wins over either (as for :meth:`Semaphore.acquire`).
            weight (int): how many units of the limit the slot takes (as for
                :meth:`Semaphore.acquire`). Default 1.
            lease (float | None): seconds the slot lives without an extend; None uses the
                semaphore's lease.
            retries (int): further attempts when every slot is held. 0 (the default) fails
                fast. A bounded spin, not a fair queue.
            retry_delay (float): seconds between attempts (``asyncio.sleep``). Default 0.1.
            metadata (Mapping[str, Any] | None): JSON-serialisable facts about the holder,
                shown by :meth:`holders` beside ``host``, ``pid`` and ``limit``.
            wait (float): seconds to wait for a slot when every one is held, woken by the
                release that frees one (BLPOP on the same wake list as
                :meth:`Semaphore.acquire`; no polling). Not together with ``retries``.
                Default 0: fail fast.
            units (Mapping[str, int] | None): as for :meth:`Semaphore.acquire`.

        Returns:
            AsyncSlot | None: the slot, which the caller must release; None if every attempt
            found all ``limit`` slots held (or was answered only after a whole lease, when
            the slot it won is given back at once rather than trusted).

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        plan = self._plan.acquire(key, limit, weight, lease, retries, retry_delay, metadata,
                                  wait, units)  # fmt: skip
        key, seconds, _, attempts, delay, wait, limit, weight, keys, token, _ = plan
        acquirer = self._acquirer
        with acquire_span(key, limit) as record:
            for attempt in range(attempts):
                if attempt:
                    await asyncio.sleep(delay)
                sent_at = time.monotonic()
                reply = await acquirer.take(plan)
                if isinstance(reply, Admitted):
                    if time.monotonic() - sent_at < seconds:
                        record(attempt + 1, "acquired")
                        return acquirer.slot(keys, key, token, seconds, reply, sent_at, weight)
                    # The reply came after a whole lease (a paused server, a stalled
                    # network): the slot cannot be trusted to be ours, so give it back.
                    await acquirer.background.finish(acquirer.give_back(keys, key, token))
            if wait and isinstance(reply, Full):
                slot = await acquirer.wait(plan)
                if slot is not None:
                    record(attempts, "acquired")
                    return slot
            record(attempts, "full")
        return None

    @contextlib.asynccontextmanager
    async def hold(
        self,
        key: str,
        *,
        limit: int | None = None,
        weight: int = 1,
        retries: int = 0,
        retry_delay: float = 0.1,
        lease: float | None = None,
        heartbeat: float | bool | None = None,
        on_renew_error: RenewErrorCallback | None = None,
        metadata: Mapping[str, Any] | None = None,
        wait: float = 0.0,
        interrupt: bool = False,
        units: Mapping[str, int] | None = None,
    ) -> AsyncIterator[AsyncSlot]:
        """Hold a slot of ``key`` for the ``async with`` block, renewing it in the background.

        Args:
            key (str): as for :meth:`acquire`.
            limit (int | None): as for :meth:`acquire`.
            weight (int): as for :meth:`acquire`.
            retries (int): as for :meth:`acquire`.
            retry_delay (float): as for :meth:`acquire`.
            lease (float | None): as for :meth:`acquire`.
            heartbeat (float | bool | None): seconds between renewals. None (default): a
                quarter of the lease, at least 0.001. False: no renewal; the slot lapses a
                lease after it was taken. An explicit value must be at most half the lease.
            on_renew_error (Callable[[BaseException], object] | None): called, in the event
                loop, with each renewal round trip that failed (a dropped connection, a
                timeout). That is not a loss: the next tick retries.
            metadata (Mapping[str, Any] | None): as for :meth:`acquire`.
            wait (float): as for :meth:`acquire`.
            interrupt (bool): cancel the task running the block the moment the slot is lost
                (the block sees :class:`asyncio.CancelledError` at its current ``await``).
                Default False: the block runs on, and can watch ``slot.lost``.
            units (Mapping[str, int] | None): as for :meth:`acquire`.

        Yields:
            AsyncSlot: the held slot. ``slot.lost`` is set the moment the slot is known gone.

        Raises:
            SemaphoreValidationError: an argument is invalid (checked before acquiring).
            SemaphoreNotAcquiredError: every attempt (or the whole wait) found all slots held,
                or :meth:`aclose` ended the wait (``reason`` ``"shutdown"``).
            SemaphoreLeaseLostError: the slot was lost while the block ran, even if the block
                itself succeeded, or it was cancelled by ``interrupt``. If the block raised,
                its exception propagates instead and ``slot.lost`` tells the loss.
            SemaphoreBackendError: Redis failed while acquiring.
        """
        key = check.check_key(key)
        interval = self._plan.hold(lease, heartbeat, on_renew_error, interrupt)
        closes = self._acquirer.closes
        slot = await self.acquire(
            key, limit=limit, weight=weight, lease=lease, retries=retries,
            retry_delay=retry_delay, metadata=metadata, wait=wait, units=units,
        )  # fmt: skip
        if slot is None:
            raise not_acquired(key, self._plan.limit_of(limit), wait,
                               closed=self._acquirer.closes != closes,
                               paused=await is_paused_async(self.admin, key))  # fmt: skip
        async with guard(slot, interval, on_renew_error, interrupt):
            yield slot

    async def run(
        self,
        key: str,
        fn: Callable[[AsyncSlot], Awaitable[T]],
        *,
        limit: int | None = None,
        weight: int = 1,
        retries: int = 0,
        retry_delay: float = 0.1,
        lease: float | None = None,
        heartbeat: float | bool | None = None,
        on_renew_error: RenewErrorCallback | None = None,
        metadata: Mapping[str, Any] | None = None,
        wait: float = 0.0,
        interrupt: bool = False,
    ) -> T:
        """Await ``fn(slot)`` while holding a slot of ``key``; return what it returns.

        Arguments, renewal and errors are those of :meth:`hold`.
        """
        async with self.hold(
            key, limit=limit, weight=weight, retries=retries, retry_delay=retry_delay,
            lease=lease, heartbeat=heartbeat,
            on_renew_error=on_renew_error, metadata=metadata, wait=wait, interrupt=interrupt,
        ) as slot:  # fmt: skip
            return await fn(slot)

    async def count(self, key: str) -> int:
        """How many live holders ``key`` has now; lapsed leases are not counted.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        return await self._acquirer.run(key, count_call(self.names.keys_of(key)))

    async def available(self, key: str, limit: int | None = None) -> int:
        """The units of ``key`` free now: its live limit if one is set, else ``limit``, else
        the semaphore's, minus the weights of its live holders; never below 0. Two round
        trips.

        Raises:
            SemaphoreValidationError: ``key`` or ``limit`` is invalid.
            SemaphoreBackendError: Redis failed.
        """
        own = self._plan.limit_of(limit)
        live = await self.admin.live_limit(key)
        return max(0, (own if live is None else live.limit) - await self.count(key))

    async def acquire_many(
        self,
        keys: KeySpecs,
        *,
        lease: float | None = None,
        retries: int = 0,
        retry_delay: float = 0.1,
        metadata: Mapping[str, Any] | None = None,
    ) -> AsyncSlotGroup | None:
        """Take a slot of every key, all in one script call or none, as
        :meth:`Semaphore.acquire_many <celery_semaphore.core.semaphore.Semaphore.acquire_many>`
        does, on the same keys (its arguments, answers and errors). Cancelling the call never
        leaves a slot held: if its script reaches Redis, every slot it took is given back as
        soon as the answer is in. A bounded spin when ``retries``: no release wakes a caller
        for keys it does not hold, so there is no ``wait``.
        """
        plan = self._plan.many(keys, lease, retries, retry_delay, metadata)
        return await take_group(self._acquirer, plan)

    @contextlib.asynccontextmanager
    async def hold_many(
        self,
        keys: KeySpecs,
        *,
        retries: int = 0,
        retry_delay: float = 0.1,
        lease: float | None = None,
        heartbeat: float | bool | None = None,
        on_renew_error: RenewErrorCallback | None = None,
        metadata: Mapping[str, Any] | None = None,
        interrupt: bool = False,
    ) -> AsyncIterator[AsyncSlotGroup]:
        """Hold a slot of every key (``keys`` as for :meth:`acquire_many`) for the ``async
        with`` block, renewing them all with the loop's other slots; the other arguments are
        :meth:`hold`'s (``interrupt`` cancels the block's task when any slot is lost). Yields
        the :class:`AsyncSlotGroup`, whose ``lost`` is set the moment any slot is known gone.

        Raises:
            SemaphoreValidationError: an argument is invalid (checked before acquiring).
            SemaphoreNotAcquiredError: every attempt found some key without room.
            SemaphoreLeaseLostError: a slot was lost while the block ran (its key is named),
                even if the block itself succeeded, or it was cancelled by ``interrupt``; if
                the block raised, that propagates.
            SemaphoreBackendError: Redis failed while acquiring.
        """
        interval = self._plan.hold(lease, heartbeat, on_renew_error, interrupt)
        group = await self.acquire_many(
            keys, lease=lease, retries=retries, retry_delay=retry_delay, metadata=metadata
        )
        if group is None:
            raise group_refused(keys)
        async with guard(group, interval, on_renew_error, interrupt):
            yield group

    async def aclose(self) -> list[AsyncSlot]:
        """Give back every slot this semaphore handed out and nobody released, wait for the
        round trips still running on its behalf, and close its client if it made it.

        A wait for a slot under way ends at once, with no slot (``hold`` raises
        :class:`SemaphoreNotAcquiredError` whose ``reason`` is ``"shutdown"``). A slot given
        back here is marked lost first ("the semaphore was closed"): a body still running
        under it is no longer bounded, and with ``interrupt=True`` it is cancelled. Each slot
        is logged, at WARNING, as released or as left to lapse (Redis failed). The semaphore
        can be used again afterwards.

        Returns:
            list[AsyncSlot]: the slots that were still held; ``slot.released`` tells which
            were given back (the others lapse within their lease).
        """
        self._acquirer.stop_waits()
        held = list(self._acquirer.held.values())
        for slot in held:
            if not slot.released:  # a release already under way is its holder's own
                slot._mark_lost("the semaphore was closed while it was held")
        outcomes = await asyncio.gather(*(s.release() for s in held), return_exceptions=True)
        for slot, outcome in zip(held, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                logger.warning(
                    "semaphore %r: slot %s still held at close, not given back (%s); it "
                    "lapses within %gs", slot.key, slot.token[:8], outcome, slot.lease,
                )  # fmt: skip
            else:
                logger.warning(
                    "semaphore %r: slot %s still held at close, given back%s", slot.key,
                    slot.token[:8], "" if outcome else " (it had lapsed already)",
                )  # fmt: skip
        await self._acquirer.background.drain(self.lease)
        if self._owns_client:
            closer = getattr(self.client, "aclose", None)  # redis-py 5.0.1+; close() before
            await (closer() if closer is not None else self.client.close())
        return held
