"""The names of a semaphore's Redis keys, all under one Redis Cluster hash tag (see the
Redis layout reference)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from redis.crc import key_slot

from ..errors import SemaphoreValidationError


class Keys(NamedTuple):
    """A semaphore's Redis keys, all under one hash tag (so in one Redis Cluster shard)."""

    slots: str
    """Sorted set: holder token (or ``~<waiter>`` reservation) -> lease expiry, ms."""
    holders: str
    """Hash: holder token -> ``<acquired_at_ms>|<metadata JSON>``."""
    limits: str
    """Hash: ``limit``, ``set_at`` (ms) and ``by`` of a live limit (set_limit.lua), which
    wins over the callers' limit while it exists."""
    room: str
    """Sorted set: parked waiter id -> its place, ms: its arrival, or its turn (tenant), less
    its head start (the waiting room's order)."""
    parked: str
    """Hash: waiter id -> ``<arrival_ms>[#<weight>][@<place>]|<payload>`` (the weight when
    above 1; the place of a waiter with a tenant or a head start), and ``!limit`` -> the
    key's limit (room.lua's ``payload_of``, ``place_of`` and ``weight_of`` read it)."""
    deadlines: str
    """Sorted set: parked waiter id -> when it gives up waiting, ms (waiters with a budget)."""
    blocked: str
    """Sorted set: token of a caller blocked on :attr:`wake` -> when it stops blocking, ms."""
    wake: str
    """List: one element per freed slot the room did not take, to wake a blocked caller."""
    claims: str
    """Hash: waiter id -> id of the delivery that claimed its hand-off."""


@functools.lru_cache(maxsize=4096)
def redis_keys(prefix: str, key: str) -> Keys:
    """The Redis keys of semaphore ``key``: ``<prefix>:{<key>}``, ``...:holders`` and the
    waiting room's (see :class:`Keys`).

    The braces are a Redis Cluster hash tag, so all keys live in one cluster shard and each
    script can touch them atomically. The one exception is a key that starts with ``}``: its
    hash tag is empty, so Redis Cluster hashes each whole name and the two keys land in
    different shards. A :class:`Semaphore` on a cluster client therefore rejects such keys
    (see :func:`check_cluster_key`); on any other client they work as usual.
    """
    return keys_named(f"{prefix}:{{{key}}}")


_SUFFIXES = ("holders", "limits", "room", "parked", "deadlines", "blocked", "wake", "claims")


def keys_named(slots: str) -> Keys:
    """The :class:`Keys` of the semaphore whose slots key is ``slots``: the room's record of
    a waiter that needs several keys names them so (see room.lua)."""
    return Keys(slots, *(f"{slots}:{name}" for name in _SUFFIXES))


def room_index_of(slots: str) -> str:
    """The room index of the semaphore whose slots key is ``slots`` (see
    :attr:`Namespace.room_index`)."""
    return slots[: slots.index("{") - 1] + ":rooms"


def check_cluster_key(key: str) -> str:
    """``key`` if its Redis keys share a Redis Cluster shard (hash slot), which all keys do
    but those that start with ``}`` (whose hash tag would be empty).

    Raises:
        SemaphoreValidationError: ``key`` starts with ``}``.
    """
    if key.startswith("}"):
        raise SemaphoreValidationError(
            f"key {key!r} starts with '}}': on Redis Cluster its two Redis keys would land in "
            "different shards; use another key (any other character first will do)",
            key,
        )
    return key


def many_redis_keys(prefix: str, keys: Sequence[str], cluster: bool) -> list[Keys]:
    """:func:`redis_keys` of each of ``keys``, which one script call takes together; with
    ``cluster`` (the client is a Redis Cluster's, sync or asyncio), each key is checked as
    :func:`check_cluster_key` does, and all must land in one cluster shard (hash slot).

    Raises:
        SemaphoreValidationError: on a cluster, a key starts with ``}``, or the keys land in
            different shards.
    """
    found = [redis_keys(prefix, check_cluster_key(key) if cluster else key) for key in keys]
    if cluster and len({key_slot(k.slots.encode()) for k in found}) > 1:
        raise SemaphoreValidationError(
            f"keys {list(keys)!r} land in different Redis Cluster shards (hash slots), so no "
            "script can take them together: start every key with the same hash tag, say "
            "'{llm}openai' and '{llm}tenant:acme'",
            keys[0],
        )
    return found


class Namespace:
    """The Redis key names of every semaphore under one prefix, as a client needs them:
    on a Redis Cluster client, keys that no script could take are refused.

    Args:
        prefix (str): the namespace, ``<prefix>:{<key>}``.
        cluster (bool): the client is a Redis Cluster's (sync or asyncio).
    """

    __slots__ = ("cluster", "prefix")

    def __init__(self, prefix: str, cluster: bool) -> None:
        self.prefix = prefix
        self.cluster = cluster

    def keys_of(self, key: str) -> Keys:
        """:func:`redis_keys` of ``key``.

        Raises:
            SemaphoreValidationError: ``key`` starts with ``}`` and the client is a cluster's.
        """
        if self.cluster:
            check_cluster_key(key)
        return redis_keys(self.prefix, key)

    def keys_of_many(self, keys: Sequence[str]) -> list[Keys]:
        """:meth:`keys_of` each of ``keys``, which one script call takes together (see
        :func:`many_redis_keys`)."""
        return many_redis_keys(self.prefix, keys, self.cluster)

    @property
    def room_index(self) -> str:
        """The sorted set of keys whose waiting room may hold waiters (key -> when its room
        is next due for a sweep, ms), which the sweeps visit instead of scanning the
        keyspace."""
        return f"{self.prefix}:rooms"

    @property
    def room_scan(self) -> str:
        """The fleet's lease on the next full scan of the keyspace for rooms missing from
        the index (a string: who took it; it lapses by itself)."""
        return f"{self.prefix}:rooms:scan"
