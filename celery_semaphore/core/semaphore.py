"""The leased counting semaphore: acquire a slot, keep it alive, give it back.

This module is the policy: leases, renewal, and when a slot counts as lost. The atomic
operations live in :mod:`celery_semaphore.core.scripts` (and its ``lua/`` files), the held
slot in :mod:`celery_semaphore.core.slot`, the renewal thread in
:mod:`celery_semaphore.core.heartbeat`, and holding a slot for a block (renewed, released,
judged) in :mod:`celery_semaphore.core.guard`. Nothing in ``celery_semaphore.core`` imports Celery.

Semantics follow the leased-semaphore spec (``shared/spec/leased-semaphore.txt``): fail fast
by default, bounded retries rather than a fair queue, lease renewal at a quarter of the lease,
and two-pronged loss detection.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

from redis import Redis, RedisCluster

from ..errors import (
    SemaphoreBackendError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from . import validation as check
from .admin import DEFAULT_PREFIX, Holder, SemaphoreAdmin
from .clients import RedisClient, client_from_url
from .group import ManyKeys
from .guard import guard as guard
from .lease import RenewErrorCallback
from .options import (
    PLAIN_KEPT,
    CheckedAcquire,
    HolderRecord,
    check_acquire,
    hold_interval,
    semaphore_options,
)
from .process import new_token
from .room import DEFAULT_CLAIM_TIMEOUT, DEFAULT_HANDOFF_GRACE, HandoffRoute, Publisher
from .scripts import REDIS_ERRORS, Admitted, Full, Keys, Scripts, backend_error, backend_errors
from .slot import Slot
from .tracing import acquire_span

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_LEASE = 60.0


class Semaphore(ManyKeys):
    """A counting semaphore in Redis whose slots are held by leases.

    At most ``limit`` holders hold a slot of one key at once, across every process that uses
    the same Redis and prefix. A holder that crashes frees its slot when its lease runs out;
    one that keeps working keeps its slot by renewing.

    Args:
        redis (redis.Redis | redis.RedisCluster | str): a redis-py client (plain,
            Sentinel-managed or cluster), or a URL to make one from (see
            :func:`client_from_url` for the URL forms and the timeouts such a client gets).
        limit (int): how many holders at once, per key. Required; >= 1.
        lease (float): default seconds a slot lives without an extend. Default 60.0.
        prefix (str): namespace of the Redis keys, ``<prefix>:{<key>}``. Default
            ``"semaphore"``; must be non-empty and free of braces.
        claim_timeout (float): seconds a slot handed to a parked waiter stays reserved for
            it before it lapses and the waiter goes back to the head of the room (see
            :meth:`park`). Default 30.0.
        on_handoff (Callable[[str, Sequence[Handoff]], object] | None): called with the key
            and the hand-offs whenever a call of this semaphore reserves freed slots for
            parked waiters: it must publish their payloads. None leaves them to lapse and be
            handed out again by a sweep.
        handoff_grace (float): seconds a reservation is kept for its waiter alone. A
            waiter whose payload is slow to arrive (its message queued behind a backlog,
            say) would leave the slot idle; past this grace a waiter that parks in person
            takes the slot, and the passed-over one keeps its place at the head of the
            room. Default 1.0; 0: strict order, never taken.

    Raises:
        SemaphoreValidationError: any argument is invalid (before any connection is made).
        SemaphoreBackendError: ``redis`` is a ``redis+cluster://`` URL and no node of it
            could be reached.

    On a Redis Cluster, keys that start with ``}`` are rejected with
    :class:`SemaphoreValidationError` (see :func:`redis_keys`).

    Example::

        sem = Semaphore("redis://localhost:6379/0", limit=20)
        with sem.hold("openai") as slot:
            call_model(prompt)
    """

    def __init__(
        self,
        redis: RedisClient | str,
        limit: int,
        lease: float = DEFAULT_LEASE,
        prefix: str = DEFAULT_PREFIX,
        claim_timeout: float = DEFAULT_CLAIM_TIMEOUT,
        on_handoff: Publisher | None = None,
        handoff_grace: float = DEFAULT_HANDOFF_GRACE,
    ) -> None:
        self.limit, self.lease, self.prefix = semaphore_options(limit, lease, prefix)
        client: RedisClient
        if isinstance(redis, str):
            client = client_from_url(redis)
        elif isinstance(redis, (Redis, RedisCluster)) and not hasattr(redis, "execute"):
            client = redis  # a pipeline is a Redis subclass, but cannot run our calls
        else:
            raise SemaphoreValidationError(
                "redis must be a redis.Redis or redis.RedisCluster client or a URL, "
                f"got {type(redis).__name__}"
            )
        self.client = client
        # Scripts needs register_script and EVALSHA only, which RedisCluster routes by key.
        self._scripts = Scripts(cast(Redis, client))
        self.handoffs = HandoffRoute(claim_timeout, on_handoff, handoff_grace)
        self.admin = SemaphoreAdmin(cast(Redis, client), prefix, self.handoffs)
        self._record = HolderRecord(self.limit)
        self._plain: dict[str, CheckedAcquire] = {}
        self._rooms: set[str] = set()

    def __repr__(self) -> str:
        return f"<Semaphore prefix={self.prefix!r} limit={self.limit} lease={self.lease:g}s>"

    def _redis_keys(self, key: str) -> Keys:
        return self.admin.keys_of(key)

    def _give_back(self, keys: Keys, key: str, token: str) -> None:
        try:
            with backend_errors(key, self.limit):
                _, handed = self._scripts.release(keys, token, self.handoffs.release_claim_ms, None)
            self.handoffs.deliver(key, handed)
        except SemaphoreBackendError:
            logger.warning("could not give back a late slot of %r; it lapses", key)

    def _metadata(
        self, metadata: Mapping[str, Any] | None, limit: int | None = None, weight: int = 1
    ) -> str:
        return self._record.encode(metadata, limit, weight)

    def _limit(self, limit: int | None) -> int:
        return self.limit if limit is None else check.check_limit(limit)

    def _check(
        self, key: str, limit: int | None, weight: int, lease: float | None, retries: int,
        delay: float, wait: float,
    ) -> CheckedAcquire:  # fmt: skip
        return check_acquire(key, limit, weight, lease, retries, delay, wait, self.limit,
                             self.lease, self._redis_keys)  # fmt: skip

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
    ) -> Slot | None:
        """Take a slot of ``key`` (one round trip per attempt), or None when all are held.

        Args:
            key (str): the semaphore's key; any non-empty str.
            limit (int | None): this call's limit for ``key`` (a limit computed per key, say);
                None: the semaphore's. A live limit set on the key (:meth:`set_limit`) wins
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
                shown by :meth:`holders` beside ``host``, ``pid`` and ``limit``.
            wait (float): seconds to wait for a slot when every one is held, woken by the
                release that frees one (no polling; see :meth:`_wait_for_slot`). A slot the
                release hands to a parked waiter (:meth:`park`) does not wake anyone. Not
                together with ``retries``. Default 0: fail fast.

        Returns:
            Slot | None: the slot, which the caller must release; None if every attempt found
            all ``limit`` slots held (or was answered only after a whole lease, when the slot
            it won is given back at once rather than trusted).

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        # A call that leaves every option at its default (the very objects of the signature,
        # which also rules out a True for a 1) was checked when its key first came.
        checked = None
        if (
            type(key) is str and limit is None and lease is None and metadata is None
            and weight is _DEFAULT["weight"] and retries is _DEFAULT["retries"]
            and retry_delay is _DEFAULT["retry_delay"] and wait is _DEFAULT["wait"]
        ):  # fmt: skip
            checked = self._plain.get(key)
            if checked is None:
                checked = self._check(key, limit, weight, lease, retries, retry_delay, wait)
                if len(self._plain) >= PLAIN_KEPT:
                    self._plain.clear()
                self._plain[key] = checked
        if checked is None:
            checked = self._check(key, limit, weight, lease, retries, retry_delay, wait)
        key, seconds, ms, attempts, delay, wait, limit, weight, keys = checked
        info = self._metadata(metadata, limit, weight)
        token = new_token()
        with acquire_span(key, limit) as record:
            for attempt in range(attempts):
                if attempt:
                    time.sleep(delay)
                sent_at = time.monotonic()
                try:
                    reply = self._scripts.acquire(keys, limit, ms, token, info, weight)
                except REDIS_ERRORS as exc:
                    raise backend_error(exc, key, limit) from exc
                if isinstance(reply, Admitted):
                    if time.monotonic() - sent_at < seconds:
                        record(attempt + 1, "acquired")
                        return self._slot(keys, key, token, seconds, reply, sent_at, weight)
                    # The reply came after a whole lease (a paused server, a stalled
                    # network): the slot cannot be trusted to be ours, so give it back.
                    self._give_back(keys, key, token)
            if wait and isinstance(reply, Full):
                slot = self._wait_for_slot(
                    keys, key, token, seconds, info, reply, wait, limit, weight
                )
                if slot is not None:
                    record(attempts, "acquired")
                    return slot
            record(attempts, "full")
        return None

    def _slot(
        self,
        keys: Keys,
        key: str,
        token: str,
        lease: float,
        admitted: Admitted,
        sent_at: float,
        weight: int = 1,
    ) -> Slot:
        return Slot(
            self._scripts, keys, key, self.limit, token, float(lease), admitted, sent_at,
            self.handoffs, weight,
        )  # fmt: skip

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
    ) -> Iterator[Slot]:
        """Hold a slot of ``key`` for the ``with`` block, renewing it in the background.

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
            on_renew_error (Callable[[BaseException], object] | None): called with each
                renewal round trip that failed (a dropped connection, a timeout). That is not
                a loss: the next tick retries. Without it such errors are dropped.
            metadata (Mapping[str, Any] | None): as for :meth:`acquire`.

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
        interval = hold_interval(lease, self.lease, heartbeat, on_renew_error)
        slot = self.acquire(
            key, limit=limit, weight=weight, lease=lease, retries=retries,
            retry_delay=retry_delay, metadata=metadata,
        )  # fmt: skip
        if slot is None:
            limit = self._limit(limit)
            raise SemaphoreNotAcquiredError(
                f"semaphore {key!r} has all {limit} slots held", key, limit
            )
        with guard(slot, interval, on_renew_error):
            yield slot

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
    ) -> T:
        """Call ``fn(slot)`` while holding a slot of ``key``; return what it returns.

        Arguments, renewal and errors are those of :meth:`hold`.
        """
        with self.hold(
            key,
            limit=limit,
            weight=weight,
            retries=retries,
            retry_delay=retry_delay,
            lease=lease,
            heartbeat=heartbeat,
            on_renew_error=on_renew_error,
            metadata=metadata,
        ) as slot:
            return fn(slot)

    def count(self, key: str) -> int:
        """How many live holders ``key`` has now; lapsed leases are not counted.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        with backend_errors(key, self.limit):
            return self._scripts.count(self._redis_keys(key))

    def available(self, key: str, limit: int | None = None) -> int:
        """The key's limit (its live limit if one is set, else ``limit``, else the
        semaphore's) minus its live holders, never below 0 (two round trips). Errors as
        :meth:`count`."""
        live = self.admin.live_limit(key)
        effective = live.limit if live is not None else self._limit(limit)
        return max(0, effective - self.count(key))

    def set_limit(self, key: str, limit: int | None, by: str | None = None) -> int | None:
        """Set the live limit of ``key`` (None: clear it) in one round trip; see
        :meth:`SemaphoreAdmin.set_limit`. Slots a raise frees go to parked waiters through
        this semaphore's ``on_handoff``.

        Args:
            key (str): the semaphore's key.
            limit (int | None): the new live limit, 1 to 2**31 - 1; None clears it.
            by (str | None): who sets it, for the views; None: ``user@host pid N``.

        Returns:
            int | None: the live limit it replaced (None: there was none).

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        return self.admin.set_limit(key, limit, by)

    def holders(self, key: str) -> list[Holder]:
        """Every live holder of ``key``, soonest expiry first. Errors as :meth:`count`."""
        return self.admin.holders(key, self.limit)

    def force_release(self, key: str, token: str) -> bool:
        """Free one holder's slot by its token; see :meth:`SemaphoreAdmin.force_release`."""
        return self.admin.force_release(key, token, self.limit)

    def force_release_all(self, key: str) -> int:
        """Free every slot of ``key`` at once; see :meth:`SemaphoreAdmin.force_release_all`.

        The displaced holders keep running; each learns of it at its next renewal or release,
        which answers "gone" (so :meth:`hold` raises :class:`SemaphoreLeaseLostError`).
        """
        return self.admin.force_release_all(key, self.limit)


_DEFAULT: dict[str, Any] = Semaphore.acquire.__kwdefaults__ or {}
"""The default objects of :meth:`Semaphore.acquire`'s options (``hold`` and ``run``, in the
same class body, share them), which a plain call passes as they are."""
