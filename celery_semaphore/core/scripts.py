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
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple

import redis
from redis.exceptions import RedisClusterException

from ..errors import SemaphoreBackendError, SemaphoreValidationError


class Keys(NamedTuple):
    """A semaphore's Redis keys, all under one hash tag (so one Redis Cluster slot)."""

    slots: str
    """Sorted set: holder token (or ``~<waiter>`` reservation) -> lease expiry, ms."""
    holders: str
    """Hash: holder token -> ``<acquired_at_ms>|<metadata JSON>``."""
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


def _lua(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")


_ROOM = ("park", "release", "sweep", "cancel")
"""Scripts that run the waiting room's shared steps (``lua/room.lua``, prepended)."""
_ALL, _PAIR = slice(0, 7), slice(0, 2)
_KEYS = {
    "acquire": _PAIR, "extend": _PAIR, "count": slice(0, 1), "holders": _PAIR,
    "force_release_all": _PAIR, "park": _ALL, "release": _ALL, "sweep": _ALL, "cancel": _ALL,
    "block": slice(5, 6),
    "waiting": slice(2, 3),
}  # fmt: skip
"""Which of a semaphore's :class:`Keys` each script takes, in order."""
_SOURCES = {name: (_lua("room") + "\n" if name in _ROOM else "") + _lua(name) for name in _KEYS}


@dataclass(frozen=True)
class Handoff:
    """A slot reserved for a parked waiter, whose payload the caller must now publish; or,
    with ``give_up``, a waiter past its deadline, whose run must now cancel itself and fail."""

    waiter: str
    payload: bytes
    give_up: bool = False


@dataclass(frozen=True)
class Parked:
    """park.lua parked the waiter: ``position`` older waiters are ahead of it."""

    position: int
    now_ms: int


@dataclass(frozen=True)
class RoomFull:
    """park.lua refused: the room already holds ``queued`` waiters (``max_queued``)."""

    queued: int


@dataclass(frozen=True)
class NotWaiting:
    """park.lua in claim mode: nothing is reserved or parked for the waiter."""


@dataclass(frozen=True)
class Admitted:
    """acquire.lua took a slot (or found the token already holding one)."""

    expires_at_ms: int
    now_ms: int


@dataclass(frozen=True)
class Full:
    """acquire.lua found every slot held by ``holders`` live holders, the first of whose
    leases lapses at ``first_expiry_ms`` (epoch ms)."""

    holders: int
    now_ms: int
    first_expiry_ms: int


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
    names = ("holders", "room", "parked", "deadlines", "blocked", "wake")
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


def _handoffs(reply: Any, start: int, give_up: bool = False) -> list[Handoff]:
    """The {waiter, payload} pairs at ``reply[start:]``."""
    return [
        Handoff(_text(reply[i]), reply[i + 1] if isinstance(reply[i + 1], bytes)
                else str(reply[i + 1]).encode(), give_up)
        for i in range(start, len(reply) - 1, 2)
    ]  # fmt: skip


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

    def _call(self, name: str, keys: Keys, *args: str | int | bytes) -> Any:
        return self._scripts[name](keys=keys[_KEYS[name]], args=args)

    def acquire(
        self, keys: Keys, limit: int, lease_ms: int, token: str, metadata: str
    ) -> Admitted | Full:
        """Take a slot if fewer than ``limit`` live holders hold one (one round trip)."""
        reply = self._call("acquire", keys, limit, lease_ms, token, metadata)
        if int(reply[0]) == 1:
            return Admitted(int(reply[1]), int(reply[2]))
        return Full(int(reply[1]), int(reply[2]), int(reply[3]))

    def block(self, keys: Keys, token: str, for_ms: int) -> int:
        """Register ``token`` as blocked on the wake list for ``for_ms``; the server's time."""
        return int(self._call("block", keys, token, for_ms))

    def extend(self, renewals: Sequence[tuple[Keys, str, int]]) -> list[int | None]:
        """Renew each ``(keys, token, lease_ms)`` in one call (all keys in one cluster hash
        slot): each one's new expiry (epoch ms), or None when its slot is gone."""
        keys = [name for k, _, _ in renewals for name in k[:2]]
        args = [value for _, token, ms in renewals for value in (token, ms)]
        reply = self._scripts["extend"](keys=keys, args=args)
        return [int(expiry) or None for expiry in reply[1:]]

    def release(self, keys: Keys, token: str, claim_ms: int) -> tuple[bool, list[Handoff]]:
        """Remove ``token``: whether it was still a live holder until now, and the hand-offs
        of the slot it freed (to the oldest parked waiter)."""
        reply = self._call("release", keys, token, claim_ms)
        return int(reply[0]) == 1, _handoffs(reply, 1)

    def park(
        self,
        keys: Keys,
        limit: int,
        lease_ms: int,
        token: str,
        metadata: str,
        waiter: str,
        arrival_ms: int | None,
        payload: bytes,
        claim_ms: int,
        room_ttl_ms: int,
        max_queued: int,
        claim_only: bool,
        deadline_ms: int,
        grace_ms: int,
    ) -> tuple[Admitted | Parked | RoomFull | NotWaiting, list[Handoff]]:
        """Take a slot in arrival order or park (see park.lua's contract)."""
        reply = self._call(
            "park", keys, limit, lease_ms, token, metadata, waiter,
            "" if arrival_ms is None else arrival_ms, payload, claim_ms, room_ttl_ms,
            max_queued, "claim" if claim_only else "park", deadline_ms, grace_ms,
        )  # fmt: skip
        status, value, now_ms = int(reply[0]), int(reply[1]), int(reply[2])
        result: Admitted | Parked | RoomFull | NotWaiting
        if status == 1:
            result = Admitted(value, now_ms)
        elif status == 0:
            result = Parked(value, now_ms)
        elif status == -1:
            result = RoomFull(value)
        else:
            result = NotWaiting()
        return result, _handoffs(reply, 3)

    def waiting(self, keys: Keys, rows: int = -1) -> tuple[int, int, list[tuple[str, int]]]:
        """The server's time (epoch ms), how many are parked, and the oldest ``rows`` parked
        ``(waiter, arrival_ms)`` (-1: all), oldest first."""
        reply = self._call("waiting", keys, rows)
        return (
            int(reply[0]),
            int(reply[1]),
            [(_text(reply[i]), int(reply[i + 1])) for i in range(2, len(reply) - 1, 2)],
        )

    def sweep(self, keys: Keys, claim_ms: int) -> tuple[bool, list[Handoff]]:
        """Requeue lapsed reservations, hand free slots to the oldest waiters and give up
        waiters past their deadline: whether the room still exists, and what to publish."""
        alive, handed, give_ups = self._call("sweep", keys, claim_ms)
        return int(alive) == 1, _handoffs(handed, 0) + _handoffs(give_ups, 0, give_up=True)

    def cancel(self, keys: Keys, waiter: str, claim_ms: int) -> tuple[bool, list[Handoff]]:
        """Take ``waiter`` out of the room: whether it was there, and the hand-offs."""
        reply = self._call("cancel", keys, waiter, claim_ms)
        return int(reply[0]) == 1, _handoffs(reply, 1)

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
