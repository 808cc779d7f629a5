"""The leased counting semaphore: acquire a slot, keep it alive, give it back.

This module is the policy: leases, renewal, and when a slot counts as lost. The atomic
operations live in :mod:`celery_semaphore.scripts` (and its ``lua/`` files); the renewal
thread in :mod:`celery_semaphore.heartbeat`. Nothing here imports Celery.

Semantics follow the leased-semaphore spec (``shared/spec/leased-semaphore.txt``): fail fast
by default, bounded retries rather than a fair queue, lease renewal at a quarter of the lease,
and two-pronged loss detection.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar, cast

from redis import Redis, RedisCluster

from . import _validation as check
from .clients import RedisClient, client_from_url
from .errors import (
    SemaphoreBackendError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from .heartbeat import Heartbeat, RenewErrorCallback
from .scripts import Admitted, Keys, Scripts, backend_errors
from .tracing import acquire_span

logger = logging.getLogger("celery_semaphore")

T = TypeVar("T")

DEFAULT_PREFIX = "semaphore"
DEFAULT_LEASE = 60.0


def redis_keys(prefix: str, key: str) -> Keys:
    """The two Redis keys of semaphore ``key``: ``<prefix>:{<key>}`` and ``...:holders``.

    The braces are a Redis Cluster hash tag, so both keys live in one cluster slot and each
    script can touch them atomically. The one exception is a key that starts with ``}``: its
    hash tag is empty, so Redis Cluster hashes each whole name and the two keys land in
    different slots. A :class:`Semaphore` on a cluster client therefore rejects such keys
    (see :func:`check_cluster_key`); on any other client they work as usual.
    """
    slots = f"{prefix}:{{{key}}}"
    return slots, f"{slots}:holders"


def check_cluster_key(key: str) -> str:
    """``key`` if its two Redis keys share a Redis Cluster slot, which all keys do but those
    that start with ``}`` (whose hash tag would be empty).

    Raises:
        SemaphoreValidationError: ``key`` starts with ``}``.
    """
    if key.startswith("}"):
        raise SemaphoreValidationError(
            f"key {key!r} starts with '}}': on Redis Cluster its two Redis keys would land in "
            "different slots; use another key (any other character first will do)",
            key,
        )
    return key


@dataclass(frozen=True)
class Holder:
    """One live holder of a semaphore, as Redis records it.

    Attributes:
        token (str): the acquisition's unique token.
        acquired_at (float): when the slot was taken, epoch seconds by the Redis clock.
        expires_at (float): when the lease lapses unless extended, epoch seconds (Redis clock).
        expires_in (float): seconds from the server's "now" to ``expires_at``.
        held_for (float): seconds from ``acquired_at`` to the server's "now".
        metadata (Mapping[str, Any]): ``host``, ``pid`` and ``limit`` of the holder, plus
            whatever it attached (a Celery task's id and name, say).
    """

    token: str
    acquired_at: float
    expires_at: float
    expires_in: float
    held_for: float
    metadata: Mapping[str, Any] = field(default_factory=dict)


class Slot:
    """One held slot of a semaphore, returned by :meth:`Semaphore.acquire`.

    Attributes:
        key (str): the semaphore's key.
        limit (int): the limit the slot was taken under.
        token (str): unique to this acquisition; proves ownership to Redis.
        lease (float): seconds the slot lives without an extend (updated by ``extend``).
        lost (threading.Event): set the moment the slot is known to be gone. Long bodies can
            poll ``slot.lost.is_set()`` or wait on it, to stop instead of running over the
            limit.
        acquired_at (float): epoch seconds, Redis clock.
        expires_at (float): epoch seconds, Redis clock, as of the last successful extend.

    A slot from :meth:`Semaphore.acquire` is not renewed in the background: call
    :meth:`extend` yourself, or use :meth:`Semaphore.hold` / :meth:`Semaphore.run`. A slot is
    also a context manager that releases it on exit.
    """

    def __init__(
        self,
        semaphore: Semaphore,
        key: str,
        token: str,
        lease: float,
        admitted: Admitted,
        sent_at: float,
    ) -> None:
        self.key = key
        self.limit = semaphore.limit
        self.token = token
        self.lease = lease
        self.lost = threading.Event()
        self.acquired_at = admitted.now_ms / 1000
        self.expires_at = admitted.expires_at_ms / 1000
        self._semaphore = semaphore
        self._keys = redis_keys(semaphore.prefix, key)
        # Local monotonic time at which the last successful acquire/extend was *sent*: the
        # lease began no earlier than that, so the slot is surely ours until _deadline.
        self._renewed_at = sent_at
        # When the extend that set the current lease was sent: an older reply must not undo it.
        self._lease_sent_at = sent_at
        self._lost_reason = ""
        self._released: bool | None = None
        self._lost_callbacks: list[Callable[[Slot], object]] = []
        # Set by a running Heartbeat, so that a changed lease re-plans its next renewal.
        self._on_lease_change: Callable[[], object] | None = None
        self._callbacks_lock = threading.Lock()

    def __repr__(self) -> str:
        state = "held" if self._released is None else "released"
        if self.lost.is_set():
            state = "lost"
        return f"<Slot key={self.key!r} limit={self.limit} token={self.token[:8]}… {state}>"

    @property
    def _deadline(self) -> float:
        return self._renewed_at + self.lease

    def _mark_lost(self, reason: str) -> None:
        with self._callbacks_lock:
            if self.lost.is_set():
                return
            self._lost_reason = reason
            self.lost.set()
            callbacks, self._lost_callbacks = self._lost_callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("lost-slot callback %r failed", callback)

    def when_lost(self, callback: Callable[[Slot], object]) -> None:
        """Call ``callback(slot)`` once, the moment the slot is known to be lost.

        It runs in whichever thread detects the loss (usually the heartbeat), or at once in
        the caller's thread if the slot is already lost. Exceptions it raises are logged.
        """
        with self._callbacks_lock:
            if not self.lost.is_set():
                self._lost_callbacks.append(callback)
                return
        callback(self)

    def _check_deadline(self) -> None:
        if self._released is None and time.monotonic() >= self._deadline:
            self._mark_lost("no renewal succeeded within one lease")

    def _renew(self, lease: float | None = None) -> bool:
        """One extend round trip; does not mark the slot lost (the caller decides)."""
        seconds = self.lease if lease is None else lease
        ms = check.lease_ms(seconds)
        sent_at = time.monotonic()
        with backend_errors(self.key, self.limit):
            expires_at_ms = self._semaphore._scripts.extend(self._keys, self.token, ms)
        if expires_at_ms is None:
            return False
        self._renewed_at = max(self._renewed_at, sent_at)
        if sent_at < self._lease_sent_at:
            return True  # a later extend has already set the lease; this reply is stale
        changed = seconds != self.lease
        self._lease_sent_at = sent_at
        self.lease = seconds
        self.expires_at = expires_at_ms / 1000
        if changed and self._on_lease_change is not None:
            self._on_lease_change()
        return True

    def extend(self, lease: float | None = None) -> bool:
        """Renew the lease for ``lease`` seconds from now (one round trip).

        Args:
            lease (float | None): new lease in seconds; None keeps the current one.

        Returns:
            bool: True when the slot was still ours and is extended; False when it is gone
            (lapsed, or taken by :meth:`Semaphore.force_release_all`), in which case
            :attr:`lost` is set. False without a round trip once the slot was released.

        Raises:
            SemaphoreValidationError: ``lease`` is not a positive finite number of seconds.
            SemaphoreBackendError: the round trip failed; the slot may well still be ours.
        """
        if lease is not None:
            check.lease_ms(lease)
        if self._released is not None:
            return False
        if self._renew(lease):
            return True
        self._mark_lost("extend found the slot gone")
        return False

    def release(self) -> bool:
        """Give the slot back (one round trip; later calls repeat the first answer).

        Returns:
            bool: True when the slot was ours up to now. False when it had lapsed or been
            taken away: the bound did not hold for the whole time it was used, and
            :attr:`lost` is set.

        Raises:
            SemaphoreBackendError: the round trip failed; the slot lapses within its lease.
        """
        if self._released is None:
            with backend_errors(self.key, self.limit):
                self._released = self._semaphore._scripts.release(self._keys, self.token)
            if not self._released:
                self._mark_lost("release found the slot already gone")
        return self._released

    def __enter__(self) -> Slot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def lease_lost_error(self) -> SemaphoreLeaseLostError:
        """The error that reports this slot's loss, naming why it was judged lost."""
        reason = self._lost_reason or "the slot was lost"
        return SemaphoreLeaseLostError(
            f"semaphore {self.key!r} (limit {self.limit}): {reason} while its body ran",
            self.key,
            self.limit,
        )


class Semaphore:
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
    ) -> None:
        self.limit = check.check_limit(limit)
        check.lease_ms(lease)
        self.lease = float(lease)
        check.check_key(prefix, "prefix")
        if "{" in prefix or "}" in prefix:
            raise SemaphoreValidationError(f"prefix must not contain braces, got {prefix!r}")
        self.prefix = prefix
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
        # On a cluster, a script's two keys must share a slot (see redis_keys).
        self._cluster = isinstance(client, RedisCluster)
        # Scripts needs register_script and EVALSHA only, which RedisCluster routes by key.
        self._scripts = Scripts(cast(Redis, client))
        self._identity = {"host": socket.gethostname()}

    def __repr__(self) -> str:
        return f"<Semaphore prefix={self.prefix!r} limit={self.limit} lease={self.lease:g}s>"

    def _redis_keys(self, key: str) -> Keys:
        """:func:`redis_keys` of ``key``; on a cluster, rejects a key they would not fit."""
        if self._cluster:
            check_cluster_key(key)
        return redis_keys(self.prefix, key)

    def _give_back(self, keys: Keys, key: str, token: str) -> None:
        try:
            with backend_errors(key, self.limit):
                self._scripts.release(keys, token)
        except SemaphoreBackendError:
            logger.warning("could not give back a late slot of %r; it lapses", key)

    def _metadata(self, metadata: Mapping[str, Any] | None) -> str:
        if metadata is not None and not isinstance(metadata, Mapping):
            raise SemaphoreValidationError(
                f"metadata must be a mapping or None, got {type(metadata).__name__}"
            )
        # host, pid and limit are facts about the holder: the caller's metadata cannot change them.
        record = {**(metadata or {}), **self._identity, "pid": os.getpid(), "limit": self.limit}
        try:
            return json.dumps(record, separators=(",", ":"), sort_keys=True)
        except (TypeError, ValueError, RecursionError) as exc:
            raise SemaphoreValidationError(f"metadata must be JSON-serialisable: {exc}") from exc

    def acquire(
        self,
        key: str,
        *,
        lease: float | None = None,
        retries: int = 0,
        retry_delay: float = 0.1,
        metadata: Mapping[str, Any] | None = None,
    ) -> Slot | None:
        """Take a slot of ``key`` (one round trip per attempt), or None when all are held.

        Args:
            key (str): the semaphore's key; any non-empty str.
            lease (float | None): seconds the slot lives without an extend; None uses the
                semaphore's lease.
            retries (int): further attempts when every slot is held. 0 (the default) fails
                fast. Retries are a bounded spin, not a fair queue: waiters are not served
                in arrival order.
            retry_delay (float): seconds between attempts. Default 0.1.
            metadata (Mapping[str, Any] | None): JSON-serialisable facts about the holder,
                shown by :meth:`holders` beside ``host``, ``pid`` and ``limit``.

        Returns:
            Slot | None: the slot, which the caller must release; None if every attempt found
            all ``limit`` slots held (or was answered only after a whole lease, when the slot
            it won is given back at once rather than trusted).

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        seconds = self.lease if lease is None else lease
        ms = check.lease_ms(seconds)
        attempts = check.check_retries(retries) + 1
        delay = check.check_delay(retry_delay)
        info = self._metadata(metadata)
        keys = self._redis_keys(key)
        token = secrets.token_hex(16)
        with acquire_span(key, self.limit) as record:
            for attempt in range(attempts):
                if attempt:
                    time.sleep(delay)
                sent_at = time.monotonic()
                with backend_errors(key, self.limit):
                    reply = self._scripts.acquire(keys, self.limit, ms, token, info)
                if isinstance(reply, Admitted):
                    if time.monotonic() - sent_at < seconds:
                        record(attempt + 1, "acquired")
                        return Slot(self, key, token, float(seconds), reply, sent_at)
                    # The reply came after a whole lease (a paused server, a stalled
                    # network): the slot cannot be trusted to be ours, so give it back.
                    self._give_back(keys, key, token)
            record(attempts, "full")
        return None

    @contextlib.contextmanager
    def hold(
        self,
        key: str,
        *,
        retries: int = 0,
        retry_delay: float = 0.1,
        lease: float | None = None,
        heartbeat: float | bool | None = None,
        on_renew_error: RenewErrorCallback | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Iterator[Slot]:
        """Hold a slot of ``key`` for the ``with`` block, renewing it in the background.

        Args:
            key, retries, retry_delay, lease, metadata: as for :meth:`acquire`.
            heartbeat (float | bool | None): seconds between renewals. None (default): a
                quarter of the lease, at least 0.001. False: no renewal; the slot lapses a
                lease after it was taken. An explicit value must be at most half the lease.
            on_renew_error (Callable[[BaseException], object] | None): called with each
                renewal round trip that failed (a dropped connection, a timeout). That is not
                a loss: the next tick retries. Without it such errors are dropped.

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
        seconds = self.lease if lease is None else lease
        check.lease_ms(seconds)
        interval = check.heartbeat_interval(heartbeat, float(seconds))
        check.check_callback(on_renew_error, "on_renew_error")
        slot = self.acquire(
            key, lease=lease, retries=retries, retry_delay=retry_delay, metadata=metadata
        )
        if slot is None:
            raise SemaphoreNotAcquiredError(
                f"semaphore {key!r} has all {self.limit} slots held", key, self.limit
            )
        with guard(slot, interval, on_renew_error):
            yield slot

    def run(
        self,
        key: str,
        fn: Callable[[Slot], T],
        *,
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

    def available(self, key: str) -> int:
        """``limit`` minus the live holders of ``key``, never below 0. Errors as :meth:`count`."""
        return max(0, self.limit - self.count(key))

    def holders(self, key: str) -> list[Holder]:
        """Every live holder of ``key``, soonest expiry first. Errors as :meth:`count`."""
        key = check.check_key(key)
        with backend_errors(key, self.limit):
            now_ms, rows = self._scripts.holders(self._redis_keys(key))
        return [holder_from_reply(t, expires, info, now_ms) for t, expires, info in rows]

    def force_release(self, key: str, token: str) -> bool:
        """Free one holder's slot by its token (from :meth:`holders`), as an operator would.

        Returns:
            bool: True when that holder was live until now.

        Raises:
            SemaphoreValidationError: ``key`` or ``token`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        check.check_key(token, "token")
        with backend_errors(key, self.limit):
            live = self._scripts.release(self._redis_keys(key), token)
        if live:
            logger.warning(
                "semaphore %r (limit %d): holder %s force-released", key, self.limit, token
            )
        return live

    def force_release_all(self, key: str) -> int:
        """Free every slot of ``key`` at once (an operator's recovery tool).

        The displaced holders keep running; each learns of it at its next renewal or release,
        which answers "gone" (so :meth:`hold` raises :class:`SemaphoreLeaseLostError`).

        Returns:
            int: how many live holders were displaced.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        with backend_errors(key, self.limit):
            displaced = self._scripts.force_release_all(self._redis_keys(key))
        logger.warning(
            "semaphore %r (limit %d): every slot force-released, %d live holder(s) displaced",
            key,
            self.limit,
            displaced,
        )
        return displaced


def holder_from_reply(token: str, expires_at_ms: int, info: str, now_ms: int) -> Holder:
    """A :class:`Holder` from one row of holders.lua's reply (see its contract)."""
    acquired, _, raw = info.partition("|")
    try:
        metadata = json.loads(raw) if raw else {}
    except ValueError:
        metadata = {"raw": raw}
    acquired_ms = int(acquired) if acquired.isdigit() else now_ms
    return Holder(
        token=token,
        acquired_at=acquired_ms / 1000,
        expires_at=expires_at_ms / 1000,
        expires_in=(expires_at_ms - now_ms) / 1000,
        held_for=(now_ms - acquired_ms) / 1000,
        metadata=metadata,
    )


@contextlib.contextmanager
def guard(
    slot: Slot, interval: float | None, on_renew_error: RenewErrorCallback | None = None
) -> Iterator[Slot]:
    """Renew ``slot`` while the block runs, then release it and judge whether it held.

    The heartbeat is stopped and joined before the release, so a renewal racing an
    intentional release is never mistaken for a loss. The loss deadline is checked again
    when the block ends (a body that never yields the GIL can starve the heartbeat), and the
    release's own answer is consulted.

    Args:
        slot (Slot): a freshly acquired slot; released on every path out of the block.
        interval (float | None): seconds between renewals; None for no renewal.
        on_renew_error: see :meth:`Semaphore.hold`.

    Raises:
        SemaphoreLeaseLostError: the block ended normally but the slot was lost meanwhile.
    """
    beat = Heartbeat(slot, interval, on_renew_error) if interval is not None else None
    if beat is not None:
        beat.start()
    failed = True
    try:
        yield slot
        failed = False
    finally:
        if beat is not None:
            beat.stop()
        slot._check_deadline()
        try:
            slot.release()
        except Exception:
            # The lease runs out by itself; a failed release must not mask the body's outcome.
            logger.warning("could not release slot of semaphore %r", slot.key, exc_info=True)
    if not failed and slot.lost.is_set():
        raise slot.lease_lost_error()
