"""The Redis side of the semaphore: Lua scripts and the replies they give.

Each operation is one Lua script (``lua/*.lua``, each opening with its contract), registered
as a redis-py :class:`~redis.commands.core.Script` and run by one EVALSHA round trip, loaded
again after a NOSCRIPT (a restarted or failed-over server). Each call is built
once as a :class:`Call` (the script, its KEYS and ARGV, and the pure function of
:mod:`celery_semaphore.core.replies` that reads its reply), which :class:`Scripts` sends
through a redis-py client and :class:`AsyncScripts` through a ``redis.asyncio`` one. This
module also maps redis-py errors to :class:`SemaphoreBackendError` (the keys are named in
:mod:`celery_semaphore.core.names`); what a reply *means* for a holder is decided in
:mod:`celery_semaphore.core.slot` and :mod:`celery_semaphore.core.semaphore`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, Generic, TypeVar

import redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio import RedisCluster as AsyncRedisCluster
from redis.exceptions import NoScriptError, RedisClusterException

from ..errors import SemaphoreBackendError
from .names import Keys as Keys
from .names import check_cluster_key as check_cluster_key
from .names import redis_keys as redis_keys
from .replies import Admitted as Admitted
from .replies import Full as Full
from .replies import Handoff as Handoff
from .replies import NotWaiting as NotWaiting
from .replies import Parked as Parked
from .replies import RoomFull as RoomFull
from .replies import (
    parse_acquire,
    parse_acquire_many,
    parse_extend,
    parse_holders,
    parse_park,
    parse_park_many,
    parse_release,
    parse_set_limit,
    parse_sweep,
    parse_waiting,
)

T = TypeVar("T")


def _lua(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")


_ROOM = ("park", "park_many", "release", "sweep", "cancel", "set_limit")
"""Scripts that run the waiting room's shared steps (``lua/room.lua``): in place of the
script's ``--[[room.lua]]`` line, so that a fast path above it never defines them, or else
at its top."""
_ROOM_MARK = "--[[room.lua]]"
_ROOM_KEYS, _PAIR = slice(0, 8), slice(0, 2)
_KEYS = {
    "acquire": slice(0, 3), "acquire_many": slice(0, 3), "extend": _PAIR,
    "count": slice(0, 1), "holders": _PAIR,
    "force_release_all": _PAIR, "park": slice(0, 9), "park_many": slice(0, 9),
    "release": _ROOM_KEYS,
    "sweep": _ROOM_KEYS, "cancel": _ROOM_KEYS, "set_limit": _ROOM_KEYS,
    "block": slice(6, 7),
    "waiting": slice(3, 5),
}  # fmt: skip
"""Which of a semaphore's :class:`Keys` each script takes, in order."""


def _source(name: str) -> str:
    text = _lua(name)
    if name not in _ROOM:
        return text
    if _ROOM_MARK in text:
        return text.replace(_ROOM_MARK, _lua("room"))
    return _lua("room") + "\n" + text


_SOURCES = {name: _source(name) for name in _KEYS}


class backend_errors:
    """Re-raise any redis-py error inside the block as :class:`SemaphoreBackendError`.

    A class rather than a generator-based context manager: it wraps every round trip, and
    entering one costs a third as much.

    Args:
        key (str): the semaphore's key, for the error.
        limit (int | None): its limit, for the error.
    """

    __slots__ = ("key", "limit")

    def __init__(self, key: str, limit: int | None = None) -> None:
        self.key = key
        self.limit = limit

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if isinstance(exc, (redis.RedisError, RedisClusterException)):
            raise SemaphoreBackendError(
                f"Redis failed for semaphore {self.key!r}: {type(exc).__name__}: {exc}",
                self.key,
                self.limit,
            ) from exc


class Call(Generic[T]):
    """One script call, built once and run by :class:`Scripts` (sync) or
    :class:`AsyncScripts` (asyncio): the script, its KEYS and ARGV, and the pure function
    that reads its reply. The builders below (``*_call``) are the only place that knows a
    script's arguments and reply, so both clients send and read exactly the same thing.

    Args:
        script (str): the script's name (a ``lua/<name>.lua`` file).
        keys (Sequence[str]): its KEYS.
        args (Sequence[str | int | bytes]): its ARGV.
        parse (Callable[[Any], T]): maps the raw reply to the result.
    """

    __slots__ = ("args", "keys", "parse", "script")

    def __init__(
        self,
        script: str,
        keys: Sequence[str],
        args: Sequence[str | int | bytes],
        parse: Callable[[Any], T],
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.parse = parse


def _of(
    script: str, keys: Keys, args: Sequence[str | int | bytes], parse: Callable[[Any], T]
) -> Call[T]:
    return Call(script, keys[_KEYS[script]], args, parse)


def _acquire_args(
    limit: int, lease_ms: int, token: str, metadata: str, weight: int
) -> tuple[str | int, ...]:
    if weight == 1:
        return limit, lease_ms, token, metadata
    return limit, lease_ms, token, metadata, weight


def acquire_call(
    keys: Keys, limit: int, lease_ms: int, token: str, metadata: str, weight: int = 1
) -> Call[Admitted | Full]:
    """Take ``weight`` units of the key if its live holders leave that many of ``limit``."""
    args = _acquire_args(limit, lease_ms, token, metadata, weight)
    return _of("acquire", keys, args, functools.partial(parse_acquire, limit=limit,
                                                        lease_ms=lease_ms))  # fmt: skip


def acquire_many_call(
    groups: Sequence[tuple[Keys, int, int]], lease_ms: int, token: str, metadata: str
) -> Call[list[Admitted] | tuple[int, Full]]:
    """Take ``weight`` units of each ``(keys, limit, weight)``, all or none (the keys in one
    cluster hash slot): an answer per key, or the index of the first key too full and its
    answer."""
    keys = [name for k, _, _ in groups for name in k[_KEYS["acquire_many"]]]
    args: list[str | int] = [lease_ms, token, metadata]
    args += [value for _, limit, weight in groups for value in (limit, weight)]
    return Call("acquire_many", keys, args, parse_acquire_many)


def block_call(keys: Keys, token: str, for_ms: int) -> Call[int]:
    """Register ``token`` as blocked on the wake list for ``for_ms``; the server's time."""
    return _of("block", keys, (token, for_ms), int)


Renewal = tuple[Keys, str, int, int]
"""What extend renews for one slot: its keys, token, new lease (ms) and weight."""


def extend_call(renewals: Sequence[Renewal]) -> Call[list[int | None]]:
    """Renew each ``(keys, token, lease_ms, weight)`` in one call (all keys in one cluster
    hash slot): each one's new expiry (epoch ms), or None when its slot is gone."""
    keys = [name for k, _, _, _ in renewals for name in k[:2]]
    args = [value for _, token, ms, weight in renewals for value in (token, ms, weight)]
    return Call("extend", keys, args, parse_extend)


def _release_args(token: str, claim_ms: int, weight: int | None) -> tuple[str | int, ...]:
    if weight == 1:
        return token, claim_ms
    return token, claim_ms, "" if weight is None else weight


def release_call(
    keys: Keys, token: str, claim_ms: int, weight: int | None = 1
) -> Call[tuple[bool, list[Handoff]]]:
    """Remove ``token`` (of ``weight`` units; None: as many as it has): whether it was still
    a live holder until now, and the hand-offs of the units it freed (to the oldest parked
    waiters)."""
    return _of("release", keys, _release_args(token, claim_ms, weight), parse_release)


def set_limit_call(
    keys: Keys, limit: int | None, by: str, claim_ms: int
) -> Call[tuple[int | None, int, list[Handoff]]]:
    """Set ``limit`` as the key's live limit (None: clear it): the live limit before it,
    the server's time, and the hand-offs of the capacity a raise freed."""
    args = ("" if limit is None else limit, by, claim_ms)
    return _of("set_limit", keys, args, parse_set_limit)


def count_call(keys: Keys) -> Call[int]:
    """How many holders are live by the server's clock."""
    return _of("count", keys, (), int)


def holders_call(keys: Keys) -> Call[tuple[int, list[tuple[str, int, str]]]]:
    """The server's time (epoch ms) and each live ``(token, expires_at_ms, info)``."""
    return _of("holders", keys, (), parse_holders)


def force_release_all_call(keys: Keys) -> Call[int]:
    """Delete the semaphore; how many live holders it had."""
    return _of("force_release_all", keys, (), int)


class Scripts:
    """The semaphore's scripts, registered once on one redis-py client.

    Args:
        client (redis.Redis): the client every call goes through.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._scripts = {name: client.register_script(src) for name, src in _SOURCES.items()}

    def _evalsha(self, name: str, keys: Sequence[str], args: Sequence[str | int | bytes]) -> Any:
        """One EVALSHA of script ``name``; after a NOSCRIPT (a restarted or failed-over
        server), loads it and sends again. Called directly rather than through redis-py's
        ``Script``, whose own checks cost more than the rest of an acquire's client side."""
        script = self._scripts[name]
        try:
            return self.client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            script.sha = self.client.script_load(script.script)
            return self.client.evalsha(script.sha, len(keys), *keys, *args)

    def run(self, call: Call[T]) -> T:
        """Send ``call`` (one EVALSHA round trip) and return its parsed reply."""
        return call.parse(self._evalsha(call.script, call.keys, call.args))

    def acquire(
        self, keys: Keys, limit: int, lease_ms: int, token: str, metadata: str, weight: int = 1
    ) -> Admitted | Full:
        """Take ``weight`` units if the live holders leave that many (one round trip)."""
        args = _acquire_args(limit, lease_ms, token, metadata, weight)
        return parse_acquire(self._evalsha("acquire", keys[:3], args), limit, lease_ms)

    def acquire_many(
        self, groups: Sequence[tuple[Keys, int, int]], lease_ms: int, token: str, metadata: str
    ) -> list[Admitted] | tuple[int, Full]:
        """Take a slot of every key or none (one round trip; see :func:`acquire_many_call`)."""
        return self.run(acquire_many_call(groups, lease_ms, token, metadata))

    def block(self, keys: Keys, token: str, for_ms: int) -> int:
        """Register ``token`` as blocked on the wake list for ``for_ms``; the server's time."""
        return self.run(block_call(keys, token, for_ms))

    def extend(self, renewals: Sequence[Renewal]) -> list[int | None]:
        """Renew each ``(keys, token, lease_ms, weight)`` in one call (see
        :func:`extend_call`)."""
        return self.run(extend_call(renewals))

    def release(
        self, keys: Keys, token: str, claim_ms: int, weight: int | None = 1
    ) -> tuple[bool, list[Handoff]]:
        """Remove ``token`` (see :func:`release_call`)."""
        args = _release_args(token, claim_ms, weight)
        return parse_release(self._evalsha("release", keys[_ROOM_KEYS], args))

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
        delivery: str = "",
        weight: int = 1,
        group: str = "",
    ) -> tuple[Admitted | Parked | RoomFull | NotWaiting, list[Handoff]]:
        """Take a slot in arrival order or park (see park.lua's contract)."""
        args = (
            limit, lease_ms, token, metadata, waiter, "" if arrival_ms is None else arrival_ms,
            payload, claim_ms, room_ttl_ms, max_queued, "claim" if claim_only else "park",
            deadline_ms, grace_ms, delivery, weight, group,
        )  # fmt: skip
        return self.run(_of("park", keys, args, parse_park))

    def park_many(
        self,
        groups: Sequence[tuple[Keys, int, int]],
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
        delivery: str = "",
    ) -> tuple[Admitted | Parked | RoomFull | NotWaiting, list[Handoff]]:
        """Take a slot of every ``(keys, limit, weight)`` in arrival order, or park in the
        room of the first that cannot take it yet (see park_many.lua's contract). A
        :class:`Parked` answer's ``index`` says which."""
        keys = [name for k, _, _ in groups for name in k[_KEYS["park_many"]]]
        args: list[str | int | bytes] = [
            lease_ms, token, metadata, waiter, "" if arrival_ms is None else arrival_ms,
            payload, claim_ms, room_ttl_ms, max_queued, "claim" if claim_only else "park",
            deadline_ms, delivery,
        ]  # fmt: skip
        args += [value for _, limit, weight in groups for value in (limit, weight)]
        return self.run(Call("park_many", keys, args, parse_park_many))

    def waiting(self, keys: Keys, rows: int = -1) -> tuple[int, int, list[tuple[str, int]]]:
        """The server's time (epoch ms), how many are parked, and the oldest ``rows`` parked
        ``(waiter, arrival_ms)`` (-1: all), oldest first."""
        return self.run(_of("waiting", keys, (rows,), parse_waiting))

    def sweep(self, keys: Keys, claim_ms: int) -> tuple[bool, list[Handoff]]:
        """Requeue lapsed reservations, hand free slots to the oldest waiters and give up
        waiters past their deadline: whether the room still exists, and what to publish."""
        return self.run(_of("sweep", keys, (claim_ms,), parse_sweep))

    def cancel(self, keys: Keys, waiter: str, claim_ms: int) -> tuple[bool, list[Handoff]]:
        """Take ``waiter`` out of the room: whether it was there, and the hand-offs."""
        return self.run(_of("cancel", keys, (waiter, claim_ms), parse_release))

    def set_limit(
        self, keys: Keys, limit: int | None, by: str, claim_ms: int
    ) -> tuple[int | None, int, list[Handoff]]:
        """Set or clear the key's live limit (see :func:`set_limit_call`)."""
        return self.run(set_limit_call(keys, limit, by, claim_ms))

    def count(self, keys: Keys) -> int:
        """How many holders are live by the server's clock."""
        return self.run(count_call(keys))

    def holders(self, keys: Keys) -> tuple[int, list[tuple[str, int, str]]]:
        """The server's time (epoch ms) and each live ``(token, expires_at_ms, info)``."""
        return self.run(holders_call(keys))

    def force_release_all(self, keys: Keys) -> int:
        """Delete the semaphore; how many live holders it had."""
        return self.run(force_release_all_call(keys))


class AsyncScripts:
    """The same scripts, registered once on one ``redis.asyncio`` client (plain or cluster).

    Calls are built by the same ``*_call`` functions as :class:`Scripts`'s, so the sync and
    the asyncio semaphore share one set of scripts and one reading of every reply.

    Args:
        client (redis.asyncio.Redis | redis.asyncio.RedisCluster): the client every call
            goes through.
    """

    def __init__(self, client: AsyncRedis | AsyncRedisCluster) -> None:
        self.client = client
        self._scripts = {name: client.register_script(src) for name, src in _SOURCES.items()}
        # redis-py's asyncio cluster client fails commands sent at once before it has read
        # the slot map, so a cluster client is initialised once, before its first call.
        self._unready = isinstance(client, AsyncRedisCluster)
        self._initialising = asyncio.Lock()

    async def run(self, call: Call[T]) -> T:
        """Send ``call`` (one EVALSHA round trip) and return its parsed reply."""
        if self._unready:
            async with self._initialising:
                if self._unready:
                    await self.client.initialize()
                    self._unready = False
        return call.parse(await self._scripts[call.script](keys=call.keys, args=call.args))
