"""Each script call, as the sync :class:`~celery_semaphore.core.scripts.Scripts` and the
asyncio :class:`~celery_semaphore.core.scripts.AsyncScripts` send it: which of a semaphore's
keys it takes, its ARGV, and the function of :mod:`celery_semaphore.core.replies` that reads
its reply."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from .names import Keys
from .replies import (
    Admitted,
    Full,
    Handoff,
    parse_acquire,
    parse_acquire_many,
    parse_extend,
    parse_holders,
    parse_release,
    parse_set_limit,
)

T = TypeVar("T")

ROOM_KEYS, _PAIR = slice(0, 8), slice(0, 2)
SCRIPT_KEYS = {
    "acquire": slice(0, 3), "acquire_many": slice(0, 3), "extend": _PAIR,
    "count": slice(0, 1), "holders": _PAIR,
    "force_release_all": _PAIR, "park": slice(0, 9), "park_many": slice(0, 9),
    "release": ROOM_KEYS,
    "sweep": ROOM_KEYS, "cancel": ROOM_KEYS, "set_limit": ROOM_KEYS,
    "block": slice(6, 7),
    "waiting": slice(3, 5),
}  # fmt: skip
"""Which of a semaphore's :class:`Keys` each script takes, in order."""


class Call(Generic[T]):
    """One script call, built once and run by a
    :class:`~celery_semaphore.core.scripts.Scripts` (sync) or an
    :class:`~celery_semaphore.core.scripts.AsyncScripts` (asyncio): the script, its KEYS and
    ARGV, and the pure function that reads its reply. The builders below (``*_call``) are
    the only place that knows a script's arguments and reply, so both clients send and read
    exactly the same thing.

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


def call_of(
    script: str, keys: Keys, args: Sequence[str | int | bytes], parse: Callable[[Any], T]
) -> Call[T]:
    """A call of ``script`` with the keys it takes (:data:`SCRIPT_KEYS`) of ``keys``."""
    return Call(script, keys[SCRIPT_KEYS[script]], args, parse)


def acquire_argv(
    limit: int, lease_ms: int, token: str, metadata: str | bytes, weight: int
) -> tuple[str | bytes | int, ...]:
    """acquire.lua's ARGV (the weight only when above 1)."""
    # Digits as bytes: redis-py sends them as they are, where an int takes it four checks.
    if weight == 1:
        return b"%d" % limit, b"%d" % lease_ms, token, metadata
    return b"%d" % limit, b"%d" % lease_ms, token, metadata, weight


def acquire_call(
    keys: Keys, limit: int, lease_ms: int, token: str, metadata: str, weight: int = 1
) -> Call[Admitted | Full]:
    """Take ``weight`` units of the key if its live holders leave that many of ``limit``."""
    args = acquire_argv(limit, lease_ms, token, metadata, weight)
    return call_of("acquire", keys, args, functools.partial(parse_acquire, limit=limit,
                                                        lease_ms=lease_ms))  # fmt: skip


def acquire_many_call(
    groups: Sequence[tuple[Keys, int, int]], lease_ms: int, token: str, metadata: str
) -> Call[list[Admitted] | tuple[int, Full]]:
    """Take ``weight`` units of each ``(keys, limit, weight)``, all or none (the keys in one
    cluster hash slot): an answer per key, or the index of the first key too full and its
    answer."""
    keys = [name for k, _, _ in groups for name in k[SCRIPT_KEYS["acquire_many"]]]
    args: list[str | int] = [lease_ms, token, metadata]
    args += [value for _, limit, weight in groups for value in (limit, weight)]
    return Call("acquire_many", keys, args, parse_acquire_many)


def block_call(keys: Keys, token: str, for_ms: int) -> Call[int]:
    """Register ``token`` as blocked on the wake list for ``for_ms``; the server's time."""
    return call_of("block", keys, (token, for_ms), int)


Renewal = tuple[Keys, str, int, int]
"""What extend renews for one slot: its keys, token, new lease (ms) and weight."""


def extend_call(renewals: Sequence[Renewal]) -> Call[list[int | None]]:
    """Renew each ``(keys, token, lease_ms, weight)`` in one call (all keys in one cluster
    hash slot): each one's new expiry (epoch ms), or None when its slot is gone."""
    keys = [name for k, _, _, _ in renewals for name in k[:2]]
    args = [value for _, token, ms, weight in renewals for value in (token, ms, weight)]
    return Call("extend", keys, args, parse_extend)


def release_argv(token: str, claim_ms: int, weight: int | None) -> tuple[str | bytes | int, ...]:
    """release.lua's ARGV (the weight only when it is not 1; "" when unknown)."""
    if weight == 1:
        return token, b"%d" % claim_ms
    return token, b"%d" % claim_ms, "" if weight is None else weight


def release_call(
    keys: Keys, token: str, claim_ms: int, weight: int | None = 1
) -> Call[tuple[bool, list[Handoff]]]:
    """Remove ``token`` (of ``weight`` units; None: as many as it has): whether it was still
    a live holder until now, and the hand-offs of the units it freed (to the oldest parked
    waiters)."""
    return call_of("release", keys, release_argv(token, claim_ms, weight), parse_release)


def set_limit_call(
    keys: Keys, limit: int | None, by: str, claim_ms: int
) -> Call[tuple[int | None, int, list[Handoff]]]:
    """Set ``limit`` as the key's live limit (None: clear it): the live limit before it,
    the server's time, and the hand-offs of the capacity a raise freed."""
    args = ("" if limit is None else limit, by, claim_ms)
    return call_of("set_limit", keys, args, parse_set_limit)


def count_call(keys: Keys) -> Call[int]:
    """How many holders are live by the server's clock."""
    return call_of("count", keys, (), int)


def holders_call(keys: Keys) -> Call[tuple[int, list[tuple[str, int, str]]]]:
    """The server's time (epoch ms) and each live ``(token, expires_at_ms, info)``."""
    return call_of("holders", keys, (), parse_holders)


def force_release_all_call(keys: Keys) -> Call[int]:
    """Delete the semaphore; how many live holders it had."""
    return call_of("force_release_all", keys, (), int)
