"""What operator tools need from the lease algorithm, without a limit: every semaphore under a
prefix, its live holders, and force release.

:class:`Semaphore` delegates its ``holders`` and ``force_release*`` here; the views (CLI,
``celery inspect semaphores``, Flower) and the worker's dead-run release use it directly,
since they see semaphores whose limit they do not know.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from ..errors import SemaphoreValidationError
from . import validation as check
from .live import LiveLimit as LiveLimit
from .live import LiveLimits
from .room import DEFAULT_CLAIM_TIMEOUT, HandoffRoute, Waiter
from .scripts import Keys, Scripts, backend_errors, check_cluster_key, redis_keys

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "semaphore"

INDEX_EVERY = 2.0
"""Seconds between two writes of one key to the room index by one process."""

_GLOB = re.compile(r"([*?\[\]\\])")


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


def many_redis_keys(prefix: str, keys: Sequence[str], cluster: bool) -> list[Keys]:
    """:func:`redis_keys` of each of ``keys``, which one script call takes together; with
    ``cluster`` (the client is a Redis Cluster's, sync or asyncio), each key is checked as
    :func:`check_cluster_key` does, and all must share one hash slot.

    Raises:
        SemaphoreValidationError: on a cluster, a key starts with ``}``, or the keys land in
            different hash slots.
    """
    found = [redis_keys(prefix, check_cluster_key(key) if cluster else key) for key in keys]
    if cluster and len({key_slot(k.slots.encode()) for k in found}) > 1:
        raise SemaphoreValidationError(
            f"keys {list(keys)!r} land in different Redis Cluster slots, so no script can "
            "take them together: start every key with the same hash tag, say "
            "'{llm}openai' and '{llm}tenant:acme'",
            keys[0],
        )
    return found


class SemaphoreAdmin(LiveLimits):
    """Read and free the slots of every semaphore under ``prefix``, whatever its limit.

    Args:
        client (redis.Redis): where the semaphores live (a cluster client works too).
        prefix (str): their key namespace (default ``"semaphore"``).

    Raises:
        SemaphoreValidationError: ``prefix`` is not a non-empty str.
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = DEFAULT_PREFIX,
        handoffs: HandoffRoute | None = None,
    ) -> None:
        self.client = client
        self.handoffs = handoffs or HandoffRoute(DEFAULT_CLAIM_TIMEOUT, None)
        self.prefix = check.check_key(prefix, "prefix")
        self._scripts = Scripts(client)
        self._indexed: dict[str, float] = {}  # key -> time.monotonic() of its last index_room
        # On a cluster, a script's two keys must share a slot (see redis_keys).
        self._cluster = isinstance(client, redis.RedisCluster)

    def keys_of(self, key: str) -> Keys:
        """:func:`redis_keys` of ``key``; on a cluster, rejects a key they would not fit.

        Raises:
            SemaphoreValidationError: ``key`` starts with ``}`` and the client is a cluster's.
        """
        if self._cluster:
            check_cluster_key(key)
        return redis_keys(self.prefix, key)

    def keys_of_many(self, keys: Sequence[str]) -> list[Keys]:
        """:meth:`keys_of` each of ``keys``, which one script call takes together; on a
        cluster, they must all share one hash slot.

        Raises:
            SemaphoreValidationError: on a cluster, the keys land in different hash slots.
        """
        return many_redis_keys(self.prefix, keys, self._cluster)

    @property
    def room_index(self) -> str:
        """The sorted set of keys whose waiting room may hold waiters (key -> last park, ms),
        which the workers' sweeps visit instead of scanning the keyspace."""
        return f"{self.prefix}:rooms"

    def index_room(self, key: str, ttl_ms: int) -> None:
        """Add ``key`` to :attr:`room_index` (its room just took a waiter), at most once per
        :data:`INDEX_EVERY` seconds per key and process, so a burst of parks costs one write.
        Never raises: a key left out is found by the next full scan (see :meth:`rooms`)."""
        now = time.monotonic()
        if now - self._indexed.get(key, -INDEX_EVERY) < INDEX_EVERY:
            return
        if len(self._indexed) > 10_000:  # many keys: forget the old ones, re-index later
            self._indexed.clear()
        self._indexed[key] = now
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.zadd(self.room_index, {key: round(time.time() * 1000)})
                pipe.pexpire(self.room_index, ttl_ms)
                pipe.execute()
        except (redis.RedisError, RedisClusterException) as exc:
            logger.warning("could not index the waiting room of %r: %s", key, exc)

    def rooms(self, full_scan: bool = False) -> list[str]:
        """The keys whose waiting rooms a sweep visits: those in :attr:`room_index`, and with
        ``full_scan`` every room a SCAN of the keyspace finds (the backstop for a parking
        process that died before it indexed its room).

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(self.room_index):
            raw = self.client.zrange(self.room_index, 0, -1)
        found = {m.decode("utf-8") if isinstance(m, bytes) else str(m) for m in raw}
        if full_scan:
            found.update(self.scan_keys(rooms=True))
        return sorted(found)

    def scan_keys(
        self, limit: int = 10_000, rooms: bool = False, limits: bool = False
    ) -> list[str]:
        """The keys of every semaphore under the prefix (SCAN, never KEYS), sorted.

        Args:
            limit (int): stop after this many keys, so a huge keyspace cannot stall a caller.
            rooms (bool): only the keys with a waiting room.
            limits (bool): only the keys with a live limit (which outlives their slots).

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        head = f"{self.prefix}:{{"
        tail = "}:room" if rooms else "}:limits" if limits else "}"
        found: list[str] = []
        pattern = _GLOB.sub(r"\\\1", head) + "*" + tail
        kind = "hash" if limits else "zset"
        with backend_errors(f"{self.prefix}:*"):
            for raw in self.client.scan_iter(match=pattern, count=500, _type=kind):
                name = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
                if name.startswith(head) and name.endswith(tail):
                    found.append(name[len(head) : -len(tail)])
                    if len(found) >= limit:
                        break
        return sorted(found)

    def holders(self, key: str, limit: int | None = None) -> list[Holder]:
        """Every live holder of ``key``, soonest expiry first (one round trip).

        Args:
            key (str): the semaphore's key.
            limit (int | None): only to name in an error.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        with backend_errors(key, limit):
            now_ms, rows = self._scripts.holders(self.keys_of(key))
        return [holder_from_reply(t, expires, info, now_ms) for t, expires, info in rows]

    def force_release(self, key: str, token: str, limit: int | None = None) -> bool:
        """Free one holder's slot by its token (from :meth:`holders`), as an operator would.

        Returns:
            bool: True when that holder was live until now.

        Raises:
            SemaphoreValidationError: ``key`` or ``token`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        check.check_key(token, "token")
        with backend_errors(key, limit):
            live, handed = self._scripts.release(
                self.keys_of(key), token, self.handoffs.release_claim_ms, None
            )
        self.handoffs.deliver(key, handed)
        if live:
            logger.warning("semaphore %r: holder %s force-released", key, token)
        return live

    def force_release_all(self, key: str, limit: int | None = None) -> int:
        """Free every slot of ``key`` at once (an operator's recovery tool).

        The displaced holders keep running; each learns of it at its next renewal or release,
        which answers "gone".

        Returns:
            int: how many live holders were displaced.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key = check.check_key(key)
        with backend_errors(key, limit):
            displaced = self._scripts.force_release_all(self.keys_of(key))
        logger.warning(
            "semaphore %r: every slot force-released, %d live holder(s) displaced", key, displaced
        )
        return displaced

    def room(self, key: str) -> list[Waiter]:
        """The waiters parked on ``key``, oldest first (not those holding a reservation).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        return self._waiting(key, -1)[1]

    def room_head(self, key: str) -> tuple[int, Waiter | None]:
        """How many waiters are parked on ``key``, and the oldest (one round trip, however
        big the room).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        count, head = self._waiting(key, 0)
        return count, (head[0] if head else None)

    def _waiting(self, key: str, last: int) -> tuple[int, list[Waiter]]:
        keys = self.keys_of(check.check_key(key))
        with backend_errors(key):
            now_ms, count, rows = self._scripts.waiting(keys, last)
        return count, [
            Waiter(waiter, arrival / 1000, (now_ms - arrival) / 1000) for waiter, arrival in rows
        ]

    def sweep(self, key: str) -> int:
        """The room's safety net for ``key``: requeue waiters whose reservation lapsed, hand
        every free slot to the oldest waiters, and give up waiters past their deadline (see
        :meth:`Semaphore.park`); a room found gone leaves :attr:`room_index`.

        Returns:
            int: how many slots were handed off and waiters given up.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        keys = self.keys_of(check.check_key(key))
        with backend_errors(key):
            alive, handed = self._scripts.sweep(keys, self.handoffs.claim_ms)
            if not alive:
                self.client.zrem(self.room_index, key)
        self.handoffs.deliver(key, handed)
        return len(handed)

    def cancel(self, key: str, waiter: str) -> bool:
        """Take ``waiter`` out of ``key``'s room (its run was revoked or expired), handing
        its reservation, if it had one, to the next waiter. True when it was there.

        Raises:
            SemaphoreValidationError: ``key`` or ``waiter`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        keys = self.keys_of(check.check_key(key))
        check.check_key(waiter, "waiter")
        with backend_errors(key):
            found, handed = self._scripts.cancel(keys, waiter, self.handoffs.claim_ms)
        self.handoffs.deliver(key, handed)
        return found

    def server_warnings(self) -> list[str]:
        """What about the server could break the semaphore's promise, for a start-up log.

        An evicting ``maxmemory-policy`` may delete a semaphore's key (they carry a TTL, so
        even the ``volatile-*`` policies pick them), which silently resets the count to zero
        and lets up to ``limit`` more holders in. Only ``noeviction`` is safe. Servers that
        refuse ``CONFIG GET`` (some managed services) yield no warning.

        Returns:
            list[str]: one sentence a problem; empty when none is found.
        """
        try:
            reply = self.client.config_get("maxmemory-policy")
        except redis.RedisError:
            return []
        policy: Any = reply.get("maxmemory-policy")
        if isinstance(policy, bytes):
            policy = policy.decode()
        if policy and policy != "noeviction":
            return [
                f"Redis maxmemory-policy is {policy!r}: under memory pressure it may evict a "
                "semaphore's key, resetting its count and admitting more than its limit; "
                "use 'noeviction' for the semaphore store"
            ]
        return []
