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

from ...core.live import text_of

_CACHE_SECONDS = 1.0
"""How long a parking or claiming process trusts the marker it read: a run parked within a
second of a restart may be stamped with the old one, and is then looked for again (found, or
sent); a hand-off claimed within a second of a restart is not checked against the result
backend (see :func:`~.handoffs.claim_or_end`)."""

_cached: dict[tuple[int, str], tuple[float, str]] = {}


def marker_key(prefix: str) -> str:
    """The marker's Redis key."""
    return f"{prefix}:incarnation"


def _run_id(client: redis.Redis | redis.RedisCluster) -> str:
    info: Any = {} if isinstance(client, redis.RedisCluster) else client.info("server")
    return str(info.get("run_id", ""))


def incarnation_of(value: object) -> str:
    """The marker as read from Redis (bytes, text, or None when missing: "")."""
    return "" if value is None else text_of(value)


def incarnation(client: redis.Redis | redis.RedisCluster, prefix: str) -> str:
    """The store's incarnation, as a parking or claiming process reads it: that of
    :func:`checked_incarnation`, at most once a second per process.

    Raises:
        redis.RedisError: the store failed.
    """
    now = time.monotonic()
    found = _cached.get((id(client), prefix))
    if found is None or now - found[0] >= _CACHE_SECONDS:
        found = _cached[(id(client), prefix)] = (now, checked_incarnation(client, prefix))
    return found[1]


def checked_incarnation(client: redis.Redis | redis.RedisCluster, prefix: str) -> str:
    """The store's incarnation, as a worker checks it on its timer: the marker, made anew
    when it is missing or was written by another run of the server (see the module).

    Raises:
        redis.RedisError: the store failed.
    """
    key = marker_key(prefix)
    value = client.get(key)
    run_id = _run_id(client)
    if value is not None and (not run_id or incarnation_of(value).endswith(f"|{run_id}")):
        return incarnation_of(value)
    fresh = f"{secrets.token_hex(8)}|{run_id}"
    if value is None:
        client.set(key, fresh, nx=True)  # whoever comes first makes it
    else:  # leaving the pipeline unwatches the key; another worker may make it anew first
        with client.pipeline(transaction=True) as pipe, contextlib.suppress(WatchError):
            pipe.watch(key)
            if pipe.get(key) == value:
                pipe.multi()
                pipe.set(key, fresh)
                pipe.execute()
    return incarnation_of(client.get(key))
