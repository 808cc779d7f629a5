"""The names of a semaphore's Redis keys, all under one Redis Cluster hash tag (see the
Redis layout reference)."""

from __future__ import annotations

import functools
from typing import NamedTuple

from ..errors import SemaphoreValidationError


class Keys(NamedTuple):
    """A semaphore's Redis keys, all under one hash tag (so one Redis Cluster slot)."""

    slots: str
    """Sorted set: holder token (or ``~<waiter>`` reservation) -> lease expiry, ms."""
    holders: str
    """Hash: holder token -> ``<acquired_at_ms>|<metadata JSON>``."""
    limits: str
    """Hash: ``limit``, ``set_at`` (ms) and ``by`` of a live limit (set_limit.lua), which
    wins over the callers' limit while it exists."""
    room: str
    """Sorted set: parked waiter id -> arrival, ms (the waiting room's order)."""
    parked: str
    """Hash: waiter id -> ``<arrival_ms>|<payload>``, and ``!limit`` -> the key's limit."""
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

    The braces are a Redis Cluster hash tag, so all keys live in one cluster slot and each
    script can touch them atomically. The one exception is a key that starts with ``}``: its
    hash tag is empty, so Redis Cluster hashes each whole name and the two keys land in
    different slots. A :class:`Semaphore` on a cluster client therefore rejects such keys
    (see :func:`check_cluster_key`); on any other client they work as usual.
    """
    slots = f"{prefix}:{{{key}}}"
    names = ("holders", "limits", "room", "parked", "deadlines", "blocked", "wake", "claims")
    return Keys(slots, *(f"{slots}:{name}" for name in names))


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
