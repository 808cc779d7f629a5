"""The Redis side of the semaphore: Lua scripts and the replies they give.

Each operation is one Lua script (``lua/*.lua``, each opening with its contract), run through
redis-py's :class:`~redis.commands.core.Script` so it costs one EVALSHA round trip and is
reloaded by itself after a NOSCRIPT (a restarted or failed-over server). This module only
maps replies to Python values and redis-py errors to :class:`SemaphoreBackendError`; what a
reply *means* for a holder is decided in :mod:`celery_semaphore.core.slot` and
:mod:`celery_semaphore.core.semaphore`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from ..errors import SemaphoreBackendError, SemaphoreValidationError

Keys = tuple[str, str]
"""A semaphore's two Redis keys: its sorted set of slots and its hash of holder metadata."""

_NAMES = ("acquire", "extend", "release", "count", "holders", "force_release_all")
_SOURCES = {
    name: resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")
    for name in _NAMES
}


@dataclass(frozen=True)
class Admitted:
    """acquire.lua took a slot (or found the token already holding one)."""

    expires_at_ms: int
    now_ms: int


@dataclass(frozen=True)
class Full:
    """acquire.lua found every slot held by ``holders`` live holders."""

    holders: int
    now_ms: int


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


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def backend_errors(key: str, limit: int | None = None) -> Iterator[None]:
    """Re-raise any redis-py error inside the block as :class:`SemaphoreBackendError`."""
    try:
        yield
    except (redis.RedisError, RedisClusterException) as exc:
        raise SemaphoreBackendError(
            f"Redis failed for semaphore {key!r}: {type(exc).__name__}: {exc}", key, limit
        ) from exc


class Scripts:
    """The semaphore's scripts, registered once on one redis-py client.

    Args:
        client (redis.Redis): the client every call goes through.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._scripts = {name: client.register_script(src) for name, src in _SOURCES.items()}

    def _call(self, name: str, keys: Keys, *args: str | int) -> Any:
        return self._scripts[name](keys=keys, args=args)

    def acquire(
        self, keys: Keys, limit: int, lease_ms: int, token: str, metadata: str
    ) -> Admitted | Full:
        """Take a slot if fewer than ``limit`` live holders hold one (one round trip)."""
        reply = self._call("acquire", keys, limit, lease_ms, token, metadata)
        if int(reply[0]) == 1:
            return Admitted(int(reply[1]), int(reply[2]))
        return Full(int(reply[1]), int(reply[2]))

    def extend(self, keys: Keys, token: str, lease_ms: int) -> int | None:
        """Renew ``token``'s lease: its new expiry (epoch ms), or None when it is gone."""
        reply = self._call("extend", keys, token, lease_ms)
        return int(reply[1]) if int(reply[0]) == 1 else None

    def release(self, keys: Keys, token: str) -> bool:
        """Remove ``token``; True when it was still a live holder until now."""
        return int(self._call("release", keys, token)) == 1

    def count(self, keys: Keys) -> int:
        """How many holders are live by the server's clock."""
        return int(self._call("count", keys))

    def holders(self, keys: Keys) -> tuple[int, list[tuple[str, int, str]]]:
        """The server's time (epoch ms) and each live ``(token, expires_at_ms, info)``."""
        reply = self._call("holders", keys)
        rows = [
            (_text(reply[i]), int(reply[i + 1]), _text(reply[i + 2]))
            for i in range(1, len(reply), 3)
        ]
        return int(reply[0]), rows

    def force_release_all(self, keys: Keys) -> int:
        """Delete the semaphore; how many live holders it had."""
        return int(self._call("force_release_all", keys))
