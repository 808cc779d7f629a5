"""Read-only views of every semaphore under a prefix: who holds what, since when, until when.

Redis holds the truth, so every view (the CLI, ``celery inspect semaphores``, the worker's
stats, the Flower page) reads it from there through these functions; that way a slot held
by a worker that died, whose lease has not yet run out, shows up too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import redis

from . import _validation as check
from .scripts import Scripts, backend_errors
from .semaphore import DEFAULT_PREFIX, Holder, holder_from_reply, logger, redis_keys

_GLOB = re.compile(r"([*?\[\]\\])")


@dataclass(frozen=True)
class SemaphoreView:
    """One semaphore as Redis has it now.

    Attributes:
        key (str): the semaphore's key.
        limit (int | None): the largest limit a live holder was admitted under (holders
            record it), or None when it has no live holder.
        holders (tuple[Holder, ...]): live holders, soonest expiry first.
    """

    key: str
    limit: int | None
    holders: tuple[Holder, ...]

    @property
    def in_use(self) -> int:
        """How many slots are held."""
        return len(self.holders)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: key, limit, in_use and each holder's fields."""
        return {
            "key": self.key,
            "limit": self.limit,
            "in_use": self.in_use,
            "holders": [dict(asdict(h), metadata=dict(h.metadata)) for h in self.holders],
        }


def scan_keys(client: redis.Redis, prefix: str = DEFAULT_PREFIX, limit: int = 10_000) -> list[str]:
    """The keys of every semaphore under ``prefix`` (SCAN, never KEYS), sorted.

    Args:
        client (redis.Redis): where the semaphores live.
        prefix (str): their key namespace.
        limit (int): stop after this many keys, so a huge keyspace cannot stall a caller.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    head = f"{prefix}:{{"
    found: list[str] = []
    with backend_errors(f"{prefix}:*"):
        for raw in client.scan_iter(match=_GLOB.sub(r"\\\1", head) + "*", count=500, _type="zset"):
            name = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            if name.startswith(head) and name.endswith("}"):
                found.append(name[len(head) : -1])
                if len(found) >= limit:
                    break
    return sorted(found)


def view(client: redis.Redis, key: str, prefix: str = DEFAULT_PREFIX) -> SemaphoreView:
    """The live holders of one semaphore (one round trip).

    Raises:
        SemaphoreValidationError: ``key`` is not a non-empty str.
        SemaphoreBackendError: Redis failed.
    """
    check.check_key(key)
    with backend_errors(key):
        now_ms, rows = Scripts(client).holders(redis_keys(prefix, key))
    holders = tuple(holder_from_reply(t, e, info, now_ms) for t, e, info in rows)
    limits = [h.metadata["limit"] for h in holders if isinstance(h.metadata.get("limit"), int)]
    return SemaphoreView(key=key, limit=max(limits) if limits else None, holders=holders)


def views(
    client: redis.Redis, keys: Iterable[str] | None = None, prefix: str = DEFAULT_PREFIX
) -> list[SemaphoreView]:
    """A view of each of ``keys``, or of every semaphore under ``prefix`` when None."""
    chosen = scan_keys(client, prefix) if keys is None else list(keys)
    return [view(client, key, prefix) for key in chosen]


def held_by_worker(
    client: redis.Redis, worker: str, prefix: str = DEFAULT_PREFIX
) -> list[dict[str, Any]]:
    """Every live slot whose holder recorded ``worker`` (a Celery node name) as its worker.

    A holder that recorded the bare host part of the node name matches too: tasks run by
    Celery's in-process test worker (``celery.contrib.testing``) see only that in
    ``request.hostname``.

    Returns:
        list[dict[str, Any]]: one dict a slot: key, task_id, task_name, pid, held_for,
        expires_in (seconds), token.
    """
    names = {worker, worker.partition("@")[2] or worker}
    rows = []
    for sem in views(client, prefix=prefix):
        for holder in sem.holders:
            meta = holder.metadata
            if meta.get("worker") in names:
                rows.append(
                    {
                        "key": sem.key,
                        "task_id": meta.get("task_id"),
                        "task_name": meta.get("task_name"),
                        "pid": meta.get("pid"),
                        "held_for": holder.held_for,
                        "expires_in": holder.expires_in,
                        "token": holder.token,
                    }
                )
    return rows


def server_warnings(client: redis.Redis) -> list[str]:
    """What about the server could break the semaphore's promise, for a start-up log.

    An evicting ``maxmemory-policy`` may delete a semaphore's key (they carry a TTL, so even
    the ``volatile-*`` policies pick them), which silently resets the count to zero and lets
    up to ``limit`` more holders in. Only ``noeviction`` is safe. Servers that refuse
    ``CONFIG GET`` (some managed services) yield no warning.

    Returns:
        list[str]: one sentence a problem; empty when none is found.
    """
    try:
        reply = client.config_get("maxmemory-policy")
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


def release_all(client: redis.Redis, key: str, prefix: str = DEFAULT_PREFIX) -> int:
    """Free every slot of ``key``; how many live holders were displaced.

    Raises:
        SemaphoreValidationError: ``key`` is not a non-empty str.
        SemaphoreBackendError: Redis failed.
    """
    check.check_key(key)
    with backend_errors(key):
        displaced = Scripts(client).force_release_all(redis_keys(prefix, key))
    logger.warning(
        "semaphore %r: every slot force-released, %d live holder(s) displaced", key, displaced
    )
    return displaced
