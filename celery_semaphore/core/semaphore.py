"""The leased counting semaphore: acquire a slot, keep it alive, give it back.

The policy of leases lives here; the atomic operations in :mod:`.scripts` (and ``lua/``),
the held slot in :mod:`.slot`, renewal in :mod:`.heartbeat`, the waiting room in :mod:`.room`
and the operator's side in :mod:`.admin`. A slot held for a block is :class:`guard`'s, here:
:meth:`Semaphore.hold` and the Celery glue around each run use it.

Semantics follow the leased-semaphore spec (``shared/spec/leased-semaphore.txt``): fail fast
by default, bounded retries rather than a fair queue, lease renewal at a quarter of the lease,
and two-pronged loss detection.

``acquire(wait=...)`` blocks until a release frees a slot, without polling. A caller that
found its key full registers its token as blocked (``block.lua``) and then blocks on the
key's wake list (BLPOP). A release that frees a slot the waiting room does not take pushes one
element there (``release.lua``), which wakes one blocked caller to try again. Each block also
ends at the soonest lease to lapse (a crashed holder frees its slot then, and nobody pushes)
and after :data:`MAX_BLOCK` seconds. Sync and asyncio callers block on one list, so a release
by either wakes either: the sync wait is :meth:`Semaphore._wait`, the asyncio one
:meth:`Acquirer.wait <celery_semaphore.asyncio.acquiring.Acquirer.wait>`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar, cast

from redis import Redis, RedisCluster

from ..errors import SemaphoreBackendError
from . import validation as check
from .admin import DEFAULT_PREFIX, SemaphoreAdmin
from .calls import block_call, count_call
from .clients import RedisClient, client_of
from .feedback import DEFAULT_MAX_COOL_DOWN, Adaptive, BackOff
from .group import SlotGroup, group_refused, take_group
from .handoff import DEFAULT_CLAIM_TIMEOUT, DEFAULT_HANDOFF_GRACE, HandoffRoute, Publisher
from .heartbeat import release_later, renewer
from .interrupt import Interrupter
from .lease import RenewErrorCallback
from .names import Keys, Namespace
from .options import DEFAULT_LEASE, AcquirePlan, KeySpecs, Planner, semaphore_options
from .rates import RateSpec, rates_of
from .refusals import is_paused, not_acquired
from .replies import Admitted, Full
from .room import WaitingRoom
from .scripts import REDIS_ERRORS, Scripts, backend_error, backend_errors
from .slot import Slot, give_back
from .tracing import acquire_span

logger = logging.getLogger(__name__)

T = TypeVar("T")
S = TypeVar("S", bound=Slot | SlotGroup)

__all__ = ["DEFAULT_LEASE", "Semaphore", "guard"]

MAX_BLOCK = 2.0
"""Longest single BLPOP, seconds: under the 5 s socket timeout of clients made from a URL."""


class guard(Generic[S]):
    """Renew ``slot`` while the ``with`` block runs, then release it and judge whether it
    held; entering gives the slot.

    The slot leaves the process's renewer (:mod:`celery_semaphore.core.heartbeat`) before
    the release, so a renewal racing an intentional release is never mistaken for a loss.
    The loss deadline is checked again when the block ends (a body that never yields the GIL
    can starve the renewer), and the release's own answer is consulted. A class rather than
    a generator: it wraps every bounded run, and is entered for a third of the cost.

    Args:
        slot (Slot | SlotGroup): a freshly acquired slot, or the slots of several keys
            (each renewed, all released); released on every path out of the block.
        interval (float | None): seconds between renewals; None for no renewal.
        on_renew_error: see :meth:`Semaphore.hold`.
        later (bool): hand the release to the process's release thread
            (:func:`~celery_semaphore.core.heartbeat.release_later`) and leave the block at
            once: the Celery glue's run path (a prefork pool process sends it inline, before
            the block is left: ``heartbeat.INLINE``). A slot only the release finds gone is
            marked lost then, not raised here (the deadline still is). A back-off is sent
            before the block is left, as ever.

    Raises:
        SemaphoreLeaseLostError: the block ended normally but the slot was lost meanwhile.
    """

    __slots__ = ("_members", "interval", "later", "on_renew_error", "slot")

    def __init__(
        self, slot: S, interval: float | None, on_renew_error: RenewErrorCallback | None = None,
        later: bool = False,
    ) -> None:  # fmt: skip
        self.slot, self.interval, self.on_renew_error, self.later = (
            slot, interval, on_renew_error, later
        )  # fmt: skip
        self._members: tuple[Slot, ...] = slot.slots if isinstance(slot, SlotGroup) else (slot,)

    def __enter__(self) -> S:
        if self.interval is not None:
            for member in self._members:
                renewer().add(member, self.interval, self.on_renew_error)
        return self.slot

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        slot = self.slot
        if self.interval is not None:
            for member in self._members:
                renewer().remove(member)
        slot._check_deadline()
        if self.later and not isinstance(exc, BackOff):
            for member in self._members:
                release_later(member)
        else:
            try:
                slot.__exit__(exc_type, exc, tb)  # a release, or a back-off
            except Exception:
                # The lease runs out by itself; a failed release must not mask the body's outcome.
                logger.warning("could not release slot of semaphore %r", slot.key, exc_info=True)
        if exc_type is None and slot.lost.is_set():
            raise slot.lease_lost_error()


class Semaphore:
    """A counting semaphore in Redis whose slots are held by leases.

    At most ``limit`` holders hold a slot of one key at once, across every process that uses
    the same Redis and prefix. A holder that crashes frees its slot when its lease runs out;
    one that keeps working keeps its slot by renewing.

    Args:
        redis (redis.Redis | redis.RedisCluster | str): a redis-py client (plain,
            Sentinel-managed or cluster), or a URL to make one from (see
            :func:`client_from_url` for the URL forms and the timeouts such a client gets).
        limit (int | Adaptive): how many holders at once, per key. Required; >= 1. An
            :class:`~celery_semaphore.core.feedback.Adaptive` limit starts at its
            ``initial`` and then adapts to the provider's answers, fleet-wide.
        lease (float): default seconds a slot lives without an extend. Default 60.0.
        prefix (str): namespace of the Redis keys, ``<prefix>:{<key>}``. Default
            ``"semaphore"``; must be non-empty and free of braces.
        claim_timeout (float): seconds a slot handed to a parked waiter stays reserved for
            it (see :class:`HandoffRoute`). Default 30.0.
        on_handoff (Callable[[str, Sequence[Handoff]], object] | None): publishes the
            payloads of parked waiters whose slots this semaphore's calls reserved (see
            :class:`HandoffRoute`); None: they lapse, and a sweep hands them out again.
        handoff_grace (float): seconds a reservation is kept for its waiter alone (see
            :class:`HandoffRoute`). Default 1.0; 0: strict order.
        rate (RateSpec): start rates of every key (``"500/m"``, a :class:`Rate`, or a list
            of them; see :mod:`.rates`): an acquire is refused, or waits, until every rate
            allows it. Default None: none.
        max_cool_down (float): seconds: the longest cool-down a back-off
            (:meth:`Slot.back_off`) may ask for; a longer hint is clamped and logged.
            Default 300.0.

    Raises:
        SemaphoreValidationError: any argument is invalid (before any connection is made).
        SemaphoreBackendError: ``redis`` is a ``redis+cluster://`` URL and no node of it
            could be reached.

    On a Redis Cluster, keys that start with ``}`` are rejected with
    :class:`SemaphoreValidationError` (see :func:`redis_keys`).

    Attributes:
        admin (SemaphoreAdmin): the operator's side of the same keys: holders, force
            release, live limits.
        room (WaitingRoom): the keys' waiting rooms: park, claim, cancel, sweep.
        handoffs (HandoffRoute): where the slots this semaphore's calls reserve for parked
            waiters go.

    Example::

        sem = Semaphore("redis://localhost:6379/0", limit=20)
        with sem.hold("openai") as slot:
            call_model(prompt)
    """

    def __init__(
        self,
        redis: RedisClient | str,
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
        self.rates = rates_of(rate)
        self.client = client = client_of(redis)
        self._owns_client = isinstance(redis, str)
        # Scripts needs register_script and EVALSHA only, which RedisCluster routes by key.
        self._scripts = scripts = Scripts(cast(Redis, client))
        self.names = Namespace(self.prefix, isinstance(client, RedisCluster))
        adaptive = limit if isinstance(limit, Adaptive) else None
        self.handoffs = HandoffRoute(claim_timeout, on_handoff, handoff_grace, adaptive,
                                     max_cool_down)  # fmt: skip
        self.admin = SemaphoreAdmin(cast(Redis, client), prefix, self.handoffs, scripts=scripts)
        self.room = WaitingRoom(cast(Redis, client), prefix, self.handoffs, limit=self.limit,
                                lease=self.lease, scripts=scripts)  # fmt: skip
        # hold and run, defined in the same class body, pass acquire's very default objects.
        self._plan = Planner(self.limit, self.lease, self.rates, self.names,
                             Semaphore.acquire.__kwdefaults__)  # fmt: skip

    def __repr__(self) -> str:
        return f"<Semaphore prefix={self.prefix!r} limit={self.limit} lease={self.lease:g}s>"

    def acquire(
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
    ) -> Slot | None:
        """Take a slot of ``key`` (one round trip per attempt), or None when all are held.

        Args:
            key (str): the semaphore's key; any non-empty str.
            limit (int | None): this call's limit for ``key`` (a limit computed per key, say);
                None: the semaphore's. A live limit (:meth:`SemaphoreAdmin.set_limit`) wins
                over either.
            weight (int): how many units of the limit the slot takes, 1 to ``limit``
                (default 1): the weights of a key's live holders never sum above its limit.
                A slot that a weight does not fit is refused like a full key.
            lease (float | None): seconds the slot lives without an extend; None uses the
                semaphore's lease.
            retries (int): further attempts when every slot is held. 0 (the default) fails
                fast. Retries are a bounded spin, not a fair queue: waiters are not served
                in arrival order.
            retry_delay (float): seconds between attempts. Default 0.1.
            metadata (Mapping[str, Any] | None): JSON-serialisable facts about the holder,
                shown by :meth:`SemaphoreAdmin.holders` beside ``host``, ``pid``, ``limit``.
            wait (float): seconds to wait for a slot when every one is held, woken by the
                release that frees one (no polling; see the module's docstring).
                A slot the release hands to a parked waiter (:meth:`WaitingRoom.park`) does
                not wake anyone. Not together with ``retries``. Default 0: fail fast.
            units (Mapping[str, int] | None): this call's units of each of the semaphore's
                start rates, by name (default: each rate's own). A call a rate refuses
                counts as one that found the key full; ``wait`` then waits for the rate.

        Returns:
            Slot | None: the slot, which the caller must release; None if every attempt found
            all ``limit`` slots held (or was answered only after a whole lease, when the slot
            it won is given back at once rather than trusted).

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        plan = self._plan.acquire(key, limit, weight, lease, retries, retry_delay, metadata,
                                  wait, units)  # fmt: skip
        key, seconds, ms, attempts, delay, wait, limit, weight, keys, token, rated = plan
        with acquire_span(key, limit) as record:
            for attempt in range(attempts):
                if attempt:
                    time.sleep(delay)
                sent_at = time.monotonic()
                try:
                    reply = self._scripts.acquire(keys, limit, ms, token, weight, rated)
                except REDIS_ERRORS as exc:
                    raise backend_error(exc, key, limit) from exc
                if isinstance(reply, Admitted):
                    if time.monotonic() - sent_at < seconds:
                        record(attempt + 1, "acquired")
                        return self._slot(keys, key, token, seconds, reply, sent_at, weight)
                    # The reply came after a whole lease (a paused server, a stalled
                    # network): the slot cannot be trusted to be ours, so give it back (one
                    # that cannot be lapses with its lease; give_back logs it).
                    give_back([self._slot(keys, key, token, seconds, reply, sent_at, weight)])
            if wait and isinstance(reply, Full):
                slot = self._wait(plan)
                if slot is not None:
                    record(attempts, "acquired")
                    return slot
            record(attempts, "full")
        return None

    def _slot(self, keys: Keys, key: str, token: str, lease: float, admitted: Admitted,
              sent_at: float, weight: int = 1) -> Slot:  # fmt: skip
        return Slot(
            self._scripts, keys, key, self.limit, token, float(lease), admitted, sent_at,
            self.handoffs, weight,
        )  # fmt: skip

    def _wait(self, plan: AcquirePlan) -> Slot | None:
        """After ``plan``'s acquire found the key full, block for up to ``plan.wait`` seconds
        until a release wakes this caller (see the module's docstring), then take
        the slot ``plan`` asks for (a call a start rate refused blocks until the rate allows
        it); None when the time is up.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        client = cast(Redis, self.client)
        give_up = time.monotonic() + plan.wait
        try:
            while (remaining := give_up - time.monotonic()) > 0:
                with backend_errors(plan.key, plan.limit):
                    # Registered before asking again: a release in between pushes a wake.
                    now_ms = self._scripts.run(
                        block_call(plan.keys, plan.token, math.ceil(remaining * 1000))
                    )
                    sent_at = time.monotonic()
                    reply = self._scripts.acquire(plan.keys, plan.limit, plan.ms, plan.token,
                                                  plan.weight, plan.rated)  # fmt: skip
                    if isinstance(reply, Admitted):
                        return self._slot(plan.keys, plan.key, plan.token, plan.seconds, reply,
                                          sent_at, plan.weight)  # fmt: skip
                    lapse = reply.first_lapse(now_ms, min(remaining, MAX_BLOCK))
                    if reply.start_ms:
                        # Only a rate's instant ends this wait; Redis times a BLPOP out on
                        # its next tick (hz 10: up to 100 ms late), which spent the rate.
                        time.sleep(lapse)
                    else:
                        client.blpop([plan.keys.wake], timeout=lapse)
            return None
        finally:
            with contextlib.suppress(SemaphoreBackendError), backend_errors(plan.key, plan.limit):
                client.zrem(plan.keys.blocked, plan.token)

    @contextlib.contextmanager
    def hold(
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
    ) -> Iterator[Slot]:
        """Hold a slot of ``key`` for the ``with`` block, renewing it in the background.

        Args:
            key (str): as for :meth:`acquire`, as are ``limit``, ``weight``, ``retries``,
                ``retry_delay``, ``lease``, ``metadata``, ``wait`` and ``units``.
            heartbeat (float | bool | None): seconds between renewals. None (default): a
                quarter of the lease, at least 0.001. False: no renewal; the slot lapses a
                lease after it was taken. An explicit value must be at most half the lease.
            on_renew_error (Callable[[BaseException], object] | None): called with each
                renewal round trip that failed (a dropped connection, a timeout). That is not
                a loss: the next tick retries. Without it such errors are dropped.
            interrupt (bool): raise :class:`~celery_semaphore.errors.LeaseInterrupted` in
                the thread running the block the moment the slot is lost (see
                :mod:`~celery_semaphore.core.interrupt`). Default False: the block runs on,
                and can watch ``slot.lost``.

        Yields:
            Slot: the held slot. ``slot.lost`` is set the moment the slot is known gone.

        Raises:
            SemaphoreValidationError: an argument is invalid (checked before acquiring).
            SemaphoreNotAcquiredError: every attempt found all slots held.
            SemaphoreLeaseLostError: the slot was lost while the block ran, even if the block
                itself succeeded. If the block raised, its exception propagates instead and
                ``slot.lost`` tells the loss.
            SemaphoreBackendError: Redis failed while acquiring.
        """
        key = check.check_key(key)
        interval = self._plan.hold(lease, heartbeat, on_renew_error, interrupt)
        slot = self.acquire(
            key, limit=limit, weight=weight, lease=lease, retries=retries,
            retry_delay=retry_delay, metadata=metadata, wait=wait, units=units,
        )  # fmt: skip
        if slot is None:
            raise not_acquired(key, self._plan.limit_of(limit), wait,
                               paused=is_paused(self.admin, key))  # fmt: skip
        interrupter = Interrupter(slot) if interrupt else contextlib.nullcontext()
        with guard(slot, interval, on_renew_error), interrupter:
            yield slot

    def acquire_many(
        self,
        keys: KeySpecs,
        *,
        lease: float | None = None,
        retries: int = 0,
        retry_delay: float = 0.1,
        metadata: Mapping[str, Any] | None = None,
    ) -> SlotGroup | None:
        """Take a slot of every key, all in one script call or none: a run bounded at
        several levels at once (the provider's limit and a tenant's) never holds one slot
        while it waits for another.

        Args:
            keys (Sequence[tuple[str, int] | tuple[str, int, int]]): ``(key, limit)`` or
                ``(key, limit, weight)`` for each key, at least one, no key twice. On Redis
                Cluster they must share a hash tag (``"{llm}openai"``,
                ``"{llm}tenant:acme"``). A live limit set on a key wins over its limit.
            lease (float | None): as for :meth:`acquire`; so are ``retries``,
                ``retry_delay`` and ``metadata``.

        Returns:
            SlotGroup | None: the slots, which the caller must release (one round trip per
            key); None if every attempt found some key without room.

        Raises:
            SemaphoreValidationError: an argument is invalid, a key is given twice, on a
                cluster the keys share no shard, or the semaphore has a ``rate`` (nothing is
                sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        plan = self._plan.many(keys, lease, retries, retry_delay, metadata)
        return take_group(self._scripts, plan, self._slot)

    @contextlib.contextmanager
    def hold_many(
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
    ) -> Iterator[SlotGroup]:
        """Hold a slot of every key (``keys`` as for :meth:`acquire_many`) for the ``with``
        block, renewing them all with the process's other slots; the other arguments are
        :meth:`hold`'s. Yields the :class:`SlotGroup`, whose ``lost`` is set the moment any
        slot is known gone.

        Raises:
            SemaphoreValidationError: an argument is invalid (checked before acquiring).
            SemaphoreNotAcquiredError: every attempt found some key without room.
            SemaphoreLeaseLostError: a slot was lost while the block ran (its key is named),
                even if the block itself succeeded; if the block raised, that propagates.
            SemaphoreBackendError: Redis failed while acquiring.
        """
        interval = self._plan.hold(lease, heartbeat, on_renew_error, interrupt)
        group = self.acquire_many(
            keys, lease=lease, retries=retries, retry_delay=retry_delay, metadata=metadata
        )
        if group is None:
            raise group_refused(keys)
        interrupter = Interrupter(group) if interrupt else contextlib.nullcontext()
        with guard(group, interval, on_renew_error), interrupter:
            yield group

    def run(
        self,
        key: str,
        fn: Callable[[Slot], T],
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
        """Call ``fn(slot)`` while holding a slot of ``key``; return what it returns.

        Arguments, renewal and errors are those of :meth:`hold`.
        """
        with self.hold(
            key, limit=limit, weight=weight, retries=retries, retry_delay=retry_delay,
            lease=lease, heartbeat=heartbeat, on_renew_error=on_renew_error,
            metadata=metadata, wait=wait, interrupt=interrupt,
        ) as slot:  # fmt: skip
            return fn(slot)

    def count(self, key: str) -> int:
        """How many live holders ``key`` has now; lapsed leases are not counted.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        with backend_errors(key, self.limit):
            return self._scripts.run(count_call(self.names.keys_of(key)))

    def available(self, key: str, limit: int | None = None) -> int:
        """The key's limit (its live limit if one is set, else ``limit``, else the
        semaphore's) minus its live holders, never below 0 (two round trips). Errors as
        :meth:`count`."""
        live = self.admin.live_limit(key)
        effective = live.limit if live is not None else self._plan.limit_of(limit)
        return max(0, effective - self.count(key))

    def close(self) -> None:
        """Close the client it made from a URL (one passed in is left open); held slots stay
        their holders' to release, and it can be used again. ``AsyncSemaphore.aclose``'s twin."""
        if self._owns_client:
            self.client.close()
