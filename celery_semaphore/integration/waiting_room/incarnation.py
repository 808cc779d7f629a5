"""The semaphore store's *incarnation*: a marker that changes whenever the store may have lost
data, which the journal (:mod:`.journal`) stamps each parked run with.

The marker is the key ``<prefix>:incarnation``, holding ``<random id>|<run_id>``, where
``run_id`` is the server's own id of its process (``INFO server``), new at every start. A
store restarted without persistence comes back without the marker; one restarted with
persistence comes back with it, but with another ``run_id``: a snapshot may be older than
the last parks (RDB), an append-only file may miss the last second (AOF ``everysec``). Either
way the marker is made anew, and the runs journaled under the old one are looked for again.
On Redis Cluster each node has its own ``run_id``, so only a marker found missing counts.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any

import redis
from redis.exceptions import WatchError

_CACHE_SECONDS = 1.0
"""How long a parking process trusts the marker it read: a run parked within a second of a
restart may be stamped with the old one, and is then looked for again (found, or sent)."""

_cached: dict[tuple[int, str], tuple[float, str]] = {}


def marker_key(prefix: str) -> str:
    """The marker's Redis key."""
    return f"{prefix}:incarnation"


def _run_id(client: redis.Redis | redis.RedisCluster) -> str:
    if isinstance(client, redis.RedisCluster):
        return ""
    info: Any = client.info("server")
    return str(info.get("run_id", ""))


def incarnation_of(value: object) -> str:
    """The marker as read from Redis (bytes, text, or None when missing: "")."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def incarnation(client: redis.Redis | redis.RedisCluster, prefix: str) -> str:
    """The store's incarnation, as a parking process stamps a run with it: the marker, read
    at most once a second per process (and made if missing).

    Raises:
        redis.RedisError: the store failed.
    """
    now = time.monotonic()
    found = _cached.get((id(client), prefix))
    if found is not None and now - found[0] < _CACHE_SECONDS:
        return found[1]
    value = client.get(marker_key(prefix))
    current = incarnation_of(value) if value is not None else _make(client, prefix)
    _cached[(id(client), prefix)] = (now, current)
    return current


def checked_incarnation(client: redis.Redis | redis.RedisCluster, prefix: str) -> str:
    """The store's incarnation, as a worker checks it on its timer: the marker, made anew
    when it is missing or was written by another run of the server (see the module).

    Raises:
        redis.RedisError: the store failed.
    """
    key = marker_key(prefix)
    value = client.get(key)
    if value is None:
        return _make(client, prefix)
    current = incarnation_of(value)
    run_id = _run_id(client)
    if not run_id or current.endswith(f"|{run_id}"):
        return current
    fresh = f"{secrets.token_hex(8)}|{run_id}"
    with client.pipeline(transaction=True) as pipe:  # leaving it unwatches the key
        pipe.watch(key)
        if pipe.get(key) == value:
            pipe.multi()
            pipe.set(key, fresh)
            with contextlib.suppress(WatchError):
                pipe.execute()
                return fresh
    return incarnation_of(client.get(key))  # another worker made it anew first


def _make(client: redis.Redis | redis.RedisCluster, prefix: str) -> str:
    """Make the marker if it is missing (whoever comes first makes it); the marker then."""
    key = marker_key(prefix)
    client.set(key, f"{secrets.token_hex(8)}|{_run_id(client)}", nx=True)
    return incarnation_of(client.get(key))
