"""Why is a task waiting: where a run stands in the waiting rooms, read from Redis.

A task id alone does not name its key, so :func:`why` looks the run up in every room the
room index lists (``<prefix>:rooms``, see :mod:`~celery_semaphore.core.room_index`), a page of
:data:`PAGE` rooms per pipelined round trip: an operator's look-up costs about R / 500 round
trips for R rooms, never a ``KEYS``. A run found in no room may hold a slot: the keys with
holders are then read (a ``SCAN`` of the keyspace, and one ``HGETALL`` of holders per key).
Each room the run is found in is read in one ``MULTI`` of its own keys (one hash tag): its
place in line, whether a hand-off reserved a slot for it, its give-up deadline, and beside it
the holders ahead of it and the limit in force, live limit and pause included.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from ..core import validation as check
from ..core.admin import DEFAULT_PREFIX, Holder, SemaphoreAdmin
from ..core.live import LiveLimit, Pause, live_limit_of, pause_of, text_of
from ..core.live_rates import RateState, rate_states, read_rate_states
from ..core.names import Namespace
from ..core.scripts import backend_errors

PAGE = 500
"""Rooms looked at per round trip."""


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

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (holders with their metadata)."""
        found = asdict(self)
        found["holders"] = [dict(asdict(h), metadata=dict(h.metadata)) for h in self.holders]
        return found


def why(client: redis.Redis, task_id: str, prefix: str = DEFAULT_PREFIX) -> list[Standing]:
    """Where run ``task_id`` stands: one :class:`Standing` per room it waits in (a run of
    several keys waits in each) or per key whose slot it holds; empty when it is in none.

    Raises:
        SemaphoreValidationError: ``task_id`` is not a non-empty str (nothing is read).
        SemaphoreBackendError: Redis failed.
    """
    task_id = check.check_key(task_id, "task_id")
    names = Namespace(prefix, isinstance(client, redis.RedisCluster))
    admin = SemaphoreAdmin(client, prefix)
    with backend_errors(task_id):
        found = [
            _standing(client, admin, names, key, task_id)
            for key in _rooms_of(client, names, task_id)
        ]
        if found:
            return found
        return [
            _holding(client, admin, names, key)
            for key in admin.scan_keys()
            if any(h.metadata.get("task_id") == task_id for h in admin.holders(key))
        ]


def _rooms_of(client: redis.Redis, names: Namespace, task_id: str) -> Iterator[str]:
    """The keys of the indexed rooms that hold ``task_id`` (parked or reserved)."""
    start = 0
    while True:
        page = [text_of(k) for k in client.zrange(names.room_index, start, start + PAGE - 1)]
        if not page:
            return
        with client.pipeline(transaction=False) as pipe:
            for key in page:
                pipe.hexists(names.keys_of(key).parked, task_id)
            answers = pipe.execute()
        yield from (key for key, there in zip(page, answers, strict=True) if there)
        start += PAGE


def _standing(
    client: redis.Redis, admin: SemaphoreAdmin, names: Namespace, key: str, task_id: str
) -> Standing:
    keys = names.keys_of(key)
    with client.pipeline(transaction=True) as pipe:
        pipe.time()
        pipe.zrank(keys.room, task_id)
        pipe.zcard(keys.room)
        pipe.zscore(keys.slots, f"~{task_id}")
        pipe.zscore(keys.deadlines, task_id)
        pipe.hget(keys.parked, task_id)
        pipe.hexists(keys.parked, f"!p:{task_id}")
        pipe.hget(keys.parked, "!limit")
        pipe.hgetall(keys.limits)
        pipe.hget(keys.parked, "!rates")
        (sec, usec), rank, queued, reserved, deadline, entry, passive, given, raw, declared = (
            pipe.execute()
        )
    now = sec + usec / 1e6
    arrival = re.match(r"\d*", text_of(entry or "")).group(0)  # type: ignore[union-attr]
    state = "reserved" if reserved is not None else "passive" if passive else "parked"
    live, paused = live_limit_of(raw), pause_of(raw)
    limit = 0 if paused else live.limit if live else int(given) if given else None
    return Standing(
        key=key, state=state, position=None if rank is None else int(rank) + 1,
        queued=int(queued), waited=now - int(arrival) / 1000 if arrival.isdigit() else None,
        reserved_for=None if reserved is None else max(0.0, float(reserved) / 1000 - now),
        gives_up_in=None if deadline is None else float(deadline) / 1000 - now,
        limit=limit, live=live, paused=paused, holders=tuple(admin.holders(key)),
        rates=rate_states(raw, text_of(declared) if declared else None, sec * 1000 + usec // 1000),
    )  # fmt: skip


def _holding(client: redis.Redis, admin: SemaphoreAdmin, names: Namespace, key: str) -> Standing:
    raw = client.hgetall(names.keys_of(key).limits)
    live, paused = live_limit_of(raw), pause_of(raw)
    holders = tuple(admin.holders(key))
    limits = [h.metadata["limit"] for h in holders if isinstance(h.metadata.get("limit"), int)]
    limit = 0 if paused else live.limit if live else max(limits) if limits else None
    return Standing(key, "holding", None, int(client.zcard(names.keys_of(key).room)), None,
                    None, None, limit, live, paused, holders,
                    read_rate_states(client, names.keys_of(key), raw))  # fmt: skip
