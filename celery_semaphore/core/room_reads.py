"""Reading the waiting rooms outside their scripts, for the views and the workers' lookups:
which indexed rooms hold a run, where it stands in one, which of some runs a room holds.

With the scripts and their call builders, this is the only code that knows the rooms' Redis
keys and hash fields (see the Redis layout reference): the callers get typed answers. The
reads are plain commands, pipelined where there are many; none runs a script.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from .admin import Holder, SemaphoreAdmin
from .live import (
    Feedback,
    LiveLimit,
    Pause,
    RateState,
    feedback_of,
    live_limit_of,
    pause_of,
    rate_states,
    read_rate_states,
    text_of,
)
from .names import Namespace
from .scripts import backend_errors

PAGE = 500
"""Rooms of the room index looked at per round trip by :func:`standings`."""


@dataclass(frozen=True)
class Standing:
    """Where a run stands in one key's waiting room, or that it holds one of its slots.

    Attributes:
        key (str): the semaphore's key.
        state (str): ``"parked"`` (in line), ``"reserved"`` (a hand-off reserved a slot for
            it: its message is on the way), ``"passive"`` (a run of several keys that lets
            this room serve others first) or ``"holding"`` (its body runs).
        position (int | None): its 1-based place in line, counting fair turns (parked only).
        queued (int): how many runs are in line on the key.
        waited (float | None): seconds since it first asked (by the server's clock).
        reserved_for (float | None): seconds its reservation still waits for its message.
        gives_up_in (float | None): seconds until its ``queue_timeout`` (or ``expires``)
            ends the wait; None: no budget.
        limit (int | None): the limit in force (0 while paused): the live limit, else the
            limit the last parked run gave.
        live (LiveLimit | None): the live limit, with who set it and when.
        paused (Pause | None): who paused the key and when.
        holders (tuple[Holder, ...]): the slots' holders, soonest expiry first.
        rates (tuple[RateState, ...]): the key's start rates: units free, next due instant.
        feedback (Feedback | None): the provider's answers: an adaptive limit, a cool-down.
    """

    key: str
    state: str
    position: int | None
    queued: int
    waited: float | None
    reserved_for: float | None
    gives_up_in: float | None
    limit: int | None
    live: LiveLimit | None = None
    paused: Pause | None = None
    holders: tuple[Holder, ...] = field(default_factory=tuple)
    rates: tuple[RateState, ...] = ()
    feedback: Feedback | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (holders with their metadata)."""
        holders = [dict(asdict(h), metadata=dict(h.metadata)) for h in self.holders]
        return dict(asdict(self), holders=holders)


def standings(admin: SemaphoreAdmin, waiter: str) -> list[Standing]:
    """Where ``waiter`` stands: one :class:`Standing` per room it waits in (a run of several
    keys waits in each), else per key whose slot it holds; empty when it is in none.

    A waiter id alone does not name its key, so every room the room index
    (``<prefix>:rooms``) lists is looked at, a page of :data:`PAGE` rooms per pipelined round
    trip: R rooms cost about R / 500 round trips, never a ``KEYS``. A waiter found in no
    room may hold a slot: the keys with holders are then read (a ``SCAN`` of the keyspace,
    and one read of holders per key). Each room the waiter is found in is read in one
    ``MULTI`` of its own keys (one hash tag): its place in line, whether a hand-off reserved
    a slot for it, its give-up deadline, and beside it the holders ahead of it and the limit
    in force, live limit and pause included.

    Raises:
        redis.RedisError, SemaphoreBackendError: Redis failed.
    """
    found = [_standing(admin, key, waiter) for key in _rooms_holding(admin, waiter)]
    return found or [
        _holding(admin, key)
        for key in admin.scan_keys()
        if any(h.metadata.get("task_id") == waiter for h in admin.holders(key))
    ]


def _rooms_holding(admin: SemaphoreAdmin, waiter: str) -> Iterator[str]:
    """The keys of the indexed rooms that hold ``waiter`` (parked or reserved)."""
    for start in itertools.count(0, PAGE):
        page = [
            text_of(k) for k in admin.client.zrange(admin.names.room_index, start, start + PAGE - 1)
        ]
        if not page:
            return
        with admin.client.pipeline(transaction=False) as pipe:
            for key in page:
                pipe.hexists(admin.names.keys_of(key).parked, waiter)
            answers = pipe.execute()
        yield from (key for key, there in zip(page, answers, strict=True) if there)


def _standing(admin: SemaphoreAdmin, key: str, waiter: str) -> Standing:
    keys = admin.names.keys_of(key)
    with admin.client.pipeline(transaction=True) as pipe:
        pipe.time()
        pipe.zrank(keys.room, waiter)
        pipe.zcard(keys.room)
        pipe.zscore(keys.slots, f"~{waiter}")
        pipe.zscore(keys.deadlines, waiter)
        pipe.hget(keys.parked, waiter)
        pipe.hexists(keys.parked, f"!p:{waiter}")
        pipe.hget(keys.parked, "!limit")
        pipe.hgetall(keys.limits)
        pipe.hget(keys.parked, "!rates")
        (sec, usec), rank, queued, reserved, deadline, entry, passive, given, raw, declared = (
            pipe.execute()
        )
    now = sec + usec / 1e6
    arrival = re.match(r"\d*", text_of(entry or "")).group(0)  # type: ignore[union-attr]
    live, paused, feedback = live_limit_of(raw), pause_of(raw), feedback_of(raw)
    adaptive = feedback.limit if feedback else None
    return Standing(
        key=key, state="reserved" if reserved is not None else "passive" if passive else "parked",
        position=None if rank is None else int(rank) + 1,
        queued=int(queued), waited=now - int(arrival) / 1000 if arrival.isdigit() else None,
        reserved_for=None if reserved is None else max(0.0, float(reserved) / 1000 - now),
        gives_up_in=None if deadline is None else float(deadline) / 1000 - now,
        limit=in_force(paused, live, adaptive, int(given) if given else None),
        live=live, paused=paused, holders=tuple(admin.holders(key)),
        rates=rate_states(raw, text_of(declared) if declared else None, sec * 1000 + usec // 1000),
        feedback=feedback,
    )  # fmt: skip


def _holding(admin: SemaphoreAdmin, key: str) -> Standing:
    keys = admin.names.keys_of(key)
    raw = admin.client.hgetall(keys.limits)
    live, paused, feedback = live_limit_of(raw), pause_of(raw), feedback_of(raw)
    holders = tuple(admin.holders(key))
    limits = [h.metadata["limit"] for h in holders if isinstance(h.metadata.get("limit"), int)]
    adaptive = feedback.limit if feedback else None
    return Standing(key, "holding", None, int(admin.client.zcard(keys.room)), None, None, None,
                    limit=in_force(paused, live, adaptive, max(limits, default=None)),
                    live=live, paused=paused, holders=holders,
                    rates=read_rate_states(admin.client, keys, raw),
                    feedback=feedback)  # fmt: skip


def in_force(
    paused: Pause | None, live: LiveLimit | None, adaptive: int | None, given: int | None
) -> int | None:
    """The limit in force, as limit.lua reads it: 0 while paused, else the live limit, else
    the adaptive limit, else ``given`` (what the callers give; None: unknown). A cool-down
    is shown apart (it ends by itself)."""
    if paused:
        return 0
    return live.limit if live else adaptive or given


def found_in_room(
    client: redis.Redis, names: Namespace, key: str, waiters: Sequence[str]
) -> list[str]:
    """Those of ``waiters`` parked in ``key``'s room or holding a reservation of it: one
    ``HEXISTS`` and one ``ZSCORE`` each, in one pipelined round trip.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    with backend_errors(key), client.pipeline(transaction=False) as pipe:
        for waiter in waiters:
            pipe.hexists(names.keys_of(key).parked, waiter)
            pipe.zscore(names.keys_of(key).slots, f"~{waiter}")
        answers: list[Any] = pipe.execute()
    return [w for n, w in enumerate(waiters) if answers[2 * n] or answers[2 * n + 1] is not None]


def parked_or_claimed(
    client: redis.Redis, prefix: str, runs: Sequence[tuple[str, Sequence[str]]], then_get: str
) -> tuple[list[bool], Any]:
    """For each run, ``(waiter, its keys)``, whether any of its keys' rooms has it (parked or
    reserved) or has a claim of it on record; and the value of ``then_get``, a string key
    read after them: all in one pipelined round trip (two ``HEXISTS`` per key of a run).

    Raises:
        redis.RedisError: Redis failed (the caller words it).
    """
    names = Namespace(prefix, isinstance(client, redis.RedisCluster))
    with client.pipeline(transaction=False) as pipe:
        for waiter, keys in runs:
            for key in keys:
                pipe.hexists(names.keys_of(key).parked, waiter)
                pipe.hexists(names.keys_of(key).claims, waiter)
        pipe.get(then_get)
        answers = iter(pipe.execute())
    # Each run's own answers, in order (a list: any() must not stop short), then the key's.
    found = [any([next(answers) for _ in range(2 * len(keys))]) for _, keys in runs]
    return found, next(answers)


def room_sizes(
    client: redis.Redis, prefix: str, start: int, count: int, keys: Sequence[str] = ()
) -> dict[str, int]:
    """How many runs wait in line in each of ``count`` rooms of the room index from rank
    ``start`` (and in each room of ``keys``): a ``ZRANGE`` of the index, then one ``ZCARD``
    per room in one pipelined round trip. Empty past the index's end.

    Raises:
        redis.RedisError: Redis failed (the caller words it).
    """
    names = Namespace(prefix, isinstance(client, redis.RedisCluster))
    found = [*keys, *map(text_of, client.zrange(names.room_index, start, start + count - 1))]
    with client.pipeline(transaction=False) as pipe:
        for key in found:
            pipe.zcard(names.keys_of(key).room)
        return dict(zip(found, map(int, pipe.execute()), strict=True))
