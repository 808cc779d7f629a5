"""Each script call, as the sync :class:`~celery_semaphore.core.scripts.Scripts` and the
asyncio :class:`~celery_semaphore.core.scripts.AsyncScripts` send it: which of a semaphore's
keys it takes, its ARGV, and the function of :mod:`celery_semaphore.core.replies` that reads
its reply."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .names import Keys, keys_named
from .replies import (
    Admitted,
    Declined,
    DueRooms,
    Early,
    Full,
    Handoff,
    NotWaiting,
    Parked,
    Released,
    RoomFull,
    parse_acquire,
    parse_acquire_many,
    parse_cancel,
    parse_claim,
    parse_due_rooms,
    parse_extend,
    parse_gather,
    parse_held,
    parse_holders,
    parse_park,
    parse_park_many,
    parse_pause,
    parse_release,
    parse_set_limit,
    parse_sweep,
    parse_take,
    parse_waiting,
)

T = TypeVar("T")

ROOM_KEYS, _PAIR = slice(0, 8), slice(0, 2)
SCRIPT_KEYS = {
    "acquire": slice(0, 4), "acquire_rated": slice(0, 4), "acquire_many": slice(0, 3),
    "extend": _PAIR,
    "count": slice(0, 1), "held": slice(0, 1), "holders": _PAIR,
    "force_release_all": _PAIR, "park": slice(0, 9), "claim": slice(0, 9),
    "take": slice(0, 5), "park_many": slice(0, 9), "claim_many": slice(0, 9),
    "release": ROOM_KEYS,
    "sweep": ROOM_KEYS, "cancel": ROOM_KEYS, "set_limit": ROOM_KEYS, "recover": ROOM_KEYS,
    "gather": slice(0, 6), "block": slice(6, 7), "set_rate": slice(2, 3),
    "waiting": slice(3, 5),
    "due_rooms": slice(0, 0), "reschedule": slice(0, 0),
}  # fmt: skip
"""Which of a semaphore's :class:`Keys` each script takes, in order (``due_rooms`` and
``reschedule`` take none: their one key is the room index)."""


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
    limit: int, lease_ms: int, token: str, weight: int, rated: tuple[str | int, ...] = ()
) -> tuple[str | bytes | int, ...]:
    """acquire.lua's ARGV (the weight only when above 1 or with rates, ``rated``); ``token``
    is the holder's member, its record in it (:func:`.process.member_of`)."""
    # Digits as bytes: redis-py sends them as they are, where an int takes it four checks.
    if weight == 1 and not rated:
        return b"%d" % limit, b"%d" % lease_ms, token
    return b"%d" % limit, b"%d" % lease_ms, token, weight, *rated


def acquire_call(
    keys: Keys, limit: int, lease_ms: int, token: str, weight: int = 1,
    rated: tuple[str | int, ...] = (),
) -> Call[Admitted | Full]:  # fmt: skip
    """Take ``weight`` units of the key if its live holders leave that many of ``limit``
    and its start rates (``rated``) allow it."""
    args = acquire_argv(limit, lease_ms, token, weight, rated)
    parse = functools.partial(parse_acquire, limit=limit, lease_ms=lease_ms)
    return call_of("acquire_rated" if rated else "acquire", keys, args, parse)


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


def release_argv(
    token: str, claim_ms: int, weight: int | None, verdict: tuple[str, ...] = ()
) -> tuple[str | bytes | int, ...]:
    """release.lua's ARGV (the weight only when it is not 1, or a verdict follows; "" when
    unknown), then the ``verdict`` on how the run went (see ``LeaseRecord._verdict``)."""
    if weight == 1 and not verdict:
        return token, b"%d" % claim_ms
    return token, b"%d" % claim_ms, "" if weight is None else weight, *verdict


def release_call(
    keys: Keys, token: str, claim_ms: int, weight: int | None = 1, verdict: tuple[str, ...] = ()
) -> Call[Released]:
    """Remove ``token`` (of ``weight`` units; None: as many as it has), telling the store how
    its run went (``verdict``): whether it was still a live holder until now (for a holder of
    one unit on a key with no room and nobody blocked: whether it was there at all, its
    lease left to the caller's own deadline), the hand-offs of the units it freed (to the
    oldest parked waiters), and after a back-off when the cool-down ends."""
    return call_of("release", keys, release_argv(token, claim_ms, weight, verdict),
                   parse_release)  # fmt: skip


def set_limit_call(
    keys: Keys, limit: int | None, by: str, claim_ms: int
) -> Call[tuple[int | None, int, list[Handoff]]]:
    """Set ``limit`` as the key's live limit (None: clear it): the live limit before it,
    the server's time, and the hand-offs of the capacity a raise freed."""
    args = ("" if limit is None else limit, by, claim_ms)
    return call_of("set_limit", keys, args, parse_set_limit)


def pause_call(
    keys: Keys, paused: bool, by: str, claim_ms: int
) -> Call[tuple[bool, list[Handoff]]]:
    """Pause the key (``paused``) or resume it, leaving its live limit alone: whether it was
    paused before, and the hand-offs of the capacity a resume frees (set_limit.lua)."""
    return call_of("set_limit", keys, ("=", by, claim_ms, "1" if paused else "0"), parse_pause)


def count_call(keys: Keys) -> Call[int]:
    """How many holders are live by the server's clock."""
    return call_of("count", keys, (), int)


def held_call(slots: Sequence[tuple[Keys, str]]) -> Call[list[bool]]:
    """Whether each ``(keys, token)`` is still a live holder by the server's clock, in one
    read-only call (all keys in one cluster hash slot); nothing is written."""
    names = [k[SCRIPT_KEYS["held"]][0] for k, _ in slots]
    return Call("held", names, [token for _, token in slots], parse_held)


def holders_call(keys: Keys) -> Call[tuple[int, list[tuple[str, int, str]]]]:
    """The server's time (epoch ms) and each live ``(token, expires_at_ms, info)``."""
    return call_of("holders", keys, (), parse_holders)


def force_release_all_call(keys: Keys) -> Call[int]:
    """Delete the semaphore; how many live holders it had."""
    return call_of("force_release_all", keys, (), int)


@dataclass(frozen=True)
class Place:
    """Where and how a waiter waits in its room: park.lua's ARGV[8], whose contract says what
    each field means. ``rates`` and ``units`` are :func:`.rates.rated`'s."""

    arrival_ms: int | None = None
    deadline_ms: int = 0
    max_queued: int = 0
    tenant: str = ""
    ahead_ms: int = 0
    rates: str = ""
    units: str = ""


def room_settings(claim_ms: int, room_ttl_ms: int, grace_ms: int) -> str:
    """The room's settings as park.lua and claim.lua take them (ARGV[7]; see waiter.lua)."""
    return json.dumps({"claim_ms": claim_ms, "ttl_ms": room_ttl_ms, "grace_ms": grace_ms})


def park_call(
    keys: Keys, limit: int, lease_ms: int, token: str, weight: int, waiter: str,
    payload: bytes, room: str, place: Place,
) -> Call[tuple[Admitted | Parked | RoomFull, list[Handoff]]]:  # fmt: skip
    """Take a slot of the key in arrival order or park ``waiter`` with ``payload`` at
    ``place``; ``room`` is :func:`room_settings`'s. See park.lua's contract; the answer and
    the hand-offs the call made."""
    args = (limit, lease_ms, token, weight, waiter, payload, room, json.dumps(vars(place)))
    parse = functools.partial(parse_park, limit=limit, lease_ms=lease_ms)
    return call_of("park", keys, args, parse)


def claim_call(
    keys: Keys, limit: int, lease_ms: int, token: str, weight: int, waiter: str,
    delivery: str, room: str,
) -> Call[tuple[Admitted | Parked | NotWaiting | Early, list[Handoff]]]:  # fmt: skip
    """Take the slot a hand-off reserved for ``waiter``, whose run came in message
    ``delivery`` ("" if unknown). See claim.lua's contract; the answer and the hand-offs."""
    args = (limit, lease_ms, token, weight, waiter, delivery, room)
    return call_of("claim", keys, args, parse_claim)


def take_call(
    keys: Keys, limit: int, lease_ms: int, token: str, weight: int = 1
) -> Call[Admitted | Declined]:
    """Take a free slot of a key that has no waiting room, or do nothing (take.lua): what a
    park would do on such a key, without the payload it would park with."""
    args = (b"%d" % limit, b"%d" % lease_ms, token, weight)
    parse = functools.partial(parse_take, limit=limit, lease_ms=lease_ms)
    return call_of("take", keys, args, parse)


def park_many_call(
    groups: Sequence[tuple[Keys, int, int]], lease_ms: int, token: str, metadata: str,
    waiter: str, arrival_ms: int | None, payload: bytes, claim_ms: int, room_ttl_ms: int,
    max_queued: int, claim_only: bool, deadline_ms: int, delivery: str = "",
) -> Call[tuple[Admitted | Parked | RoomFull | NotWaiting, list[Handoff]]]:  # fmt: skip
    """Take a slot of every ``(keys, limit, weight)`` in arrival order, or park in the room
    of the first that cannot take it yet (see park_many.lua's contract); with
    ``claim_only``, claim what a hand-off reserved (claim_many.lua). A :class:`Parked`
    answer's ``index`` says which room."""
    keys = [name for k, _, _ in groups for name in k[SCRIPT_KEYS["park_many"]]]
    how = {"arrival_ms": arrival_ms, "claim_ms": claim_ms, "ttl_ms": room_ttl_ms,
           "max_queued": max_queued, "deadline_ms": deadline_ms,
           "delivery": delivery}  # fmt: skip
    sizes = [value for _, limit, weight in groups for value in (limit, weight)]
    args = (lease_ms, token, metadata, waiter, payload, json.dumps(how), json.dumps(sizes))
    return Call("claim_many" if claim_only else "park_many", keys, args, parse_park_many)


def waiting_call(
    keys: Keys, rows: int = -1, first: int = 0
) -> Call[tuple[int, int, list[tuple[str, int]]]]:
    """The server's time (epoch ms), how many are parked, and the parked
    ``(waiter, arrival_ms)`` from index ``first`` to index ``rows`` (-1: to the end), first
    served first."""
    return call_of("waiting", keys, (rows, first), parse_waiting)


def sweep_call(keys: Keys, claim_ms: int, idle_ms: int) -> Call[tuple[bool, list[Handoff], int]]:
    """Requeue lapsed reservations, hand free slots to the oldest waiters and give up
    waiters past their deadline: whether the room still exists, what to publish, and when
    the room next needs a sweep (at most ``idle_ms`` from now; see sweep.lua)."""
    return call_of("sweep", keys, (claim_ms, idle_ms), parse_sweep)


def cancel_call(
    keys: Sequence[Keys], waiter: str, claim_ms: int
) -> Call[tuple[bool, list[Handoff], tuple[str, ...]]]:
    """Take ``waiter`` out of the room of each of ``keys`` (one key's, or every key of a
    waiter of several keys): whether it was there, and the hand-offs; or, given one key of
    a waiter of several, the slots keys of all of them, nothing done (see cancel.lua)."""
    names = [name for k in keys for name in k[SCRIPT_KEYS["cancel"]]]
    return Call("cancel", names, (waiter, claim_ms), parse_cancel)


def gather_call(handoff: Handoff, claim_ms: int) -> Call[list[Handoff]]:
    """Hand off the waiter of ``handoff`` (one with ``gather``: it needs several keys) if it
    holds a reservation of each of them now (see gather.lua): the hand-offs to publish, and
    more waiters to gather."""
    names = [name for slots in handoff.gather for name in keys_named(slots)[SCRIPT_KEYS["gather"]]]
    return Call("gather", names, (handoff.waiter, claim_ms), parse_gather)


def recover_call(keys: Keys, token: str, claim_ms: int, since_ms: int) -> Call[Released]:
    """After a call of ``token`` ("" for none) sent ``since_ms`` ago whose answer was lost:
    whether the token still held a slot (it is given back now), and the hand-offs to
    publish: the reservations made since, and the slots handed off now (see recover.lua)."""
    return call_of("recover", keys, (token, claim_ms, max(0, since_ms)), parse_release)


def due_rooms_call(index: str, interval_ms: int, count: int, ttl_ms: int) -> Call[DueRooms]:
    """Take up to ``count`` rooms due for a sweep from the room ``index`` (its Redis key), and
    make each due again ``interval_ms`` later; the index lives at least ``ttl_ms`` more once
    a room is taken (see due_rooms.lua)."""
    return Call("due_rooms", [index], (interval_ms, count, ttl_ms), parse_due_rooms)


def reschedule_call(index: str, rooms: Sequence[tuple[str, int, int]]) -> Call[int]:
    """Score each room of ``rooms`` (key, its score when taken, when next due; epoch ms) in
    the room ``index`` with when it is next due, unless a mark brought it sooner since (see
    reschedule.lua): how many were scored."""
    args = tuple(value for room in rooms for value in room)
    return Call("reschedule", [index], args, int)
