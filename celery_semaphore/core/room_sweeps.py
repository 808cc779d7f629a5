"""Sweeps of many waiting rooms in one round trip.

A worker sweeps the rooms due a page at a time (see :meth:`.room_index.RoomIndex.due`). One
``sweep.lua`` call per room, each its own round trip, made a worker's share of the rooms
cost its round-trip time each (a millisecond or more on a busy host, where the script itself
takes a tenth of that): so the page's calls go in one pipeline, each still atomic on its own,
and what they hand off is delivered room by room after. Each sweep answers when its room
next needs one, and the index is told so in one more round trip: a room where nothing can
fall due is swept once per ``idle`` seconds (a quarter of its TTL, by default), which only
keeps its keys alive, since whatever could fall due in it later brings its sweep on itself
(see sweep.lua).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from . import validation as check
from .calls import sweep_call
from .handoff import HandoffRoute
from .names import Namespace
from .recovery import recover_later
from .room_index import RoomIndex
from .scripts import REDIS_ERRORS, Scripts, backend_error

MAX_IDLE_MS = 2**31 - 1
"""The longest idle a sweep is asked for (about 25 days): sweep.lua caps it at a quarter of
each room's TTL."""


def sweep_rooms(
    scripts: Scripts,
    names: Namespace,
    handoffs: HandoffRoute,
    index: RoomIndex,
    keys: Sequence[str],
    idle: float | None = None,
    taken_ms: int | None = None,
) -> int:
    """Sweep the room of each of ``keys`` (see :meth:`.room.WaitingRoom.sweep`): every
    ``sweep.lua`` call in one pipelined round trip, then each room's hand-offs delivered,
    each room found gone taken out of the ``index``, and every other room scored in it with
    when it next needs a sweep.

    Args:
        scripts (Scripts): the scripts, registered on the rooms' client.
        names (Namespace): the rooms' key names.
        handoffs (HandoffRoute): where the hand-offs and give-ups go.
        index (RoomIndex): the room index, which a room found gone leaves.
        keys (Sequence[str]): the semaphore keys whose rooms to sweep.
        idle (float | None): the most seconds a room may go unswept when nothing in it
            falls due sooner (None, or more than a quarter of the room's TTL: that quarter,
            so that the sweeps keep the room's keys alive).
        taken_ms (int | None): the score every room of ``keys`` was given in the index when
            it was taken to sweep (:meth:`.room_index.RoomIndex.due`); None: the rooms'
            scores are read first (one more round trip), so that a room whose score a mark
            lowered meanwhile keeps it.

    Returns:
        int: how many slots were handed off and waiters given up, in every room.

    Raises:
        SemaphoreValidationError: a key is not a non-empty str (nothing is sent).
        SemaphoreBackendError: Redis failed: the round trip (each room's call is then put
            right once the store answers, as a single sweep's would be), or one room's call
            or removal from the index (the other rooms are swept all the same; the first
            such error is raised once they are).
    """
    rooms = [(key, names.keys_of(check.check_key(key))) for key in keys]
    if not rooms:
        return 0
    claim_ms = handoffs.claim_ms
    idle_ms = MAX_IDLE_MS if idle is None else max(1, min(MAX_IDLE_MS, round(idle * 1000)))
    taken = index.scores([key for key, _ in rooms]) if taken_ms is None else None
    sent_at = time.monotonic()
    try:
        answers = scripts.run_many([sweep_call(k, claim_ms, idle_ms) for _, k in rooms])
    except REDIS_ERRORS as exc:
        for key, k in rooms:
            recover_later(scripts, k, key, "", handoffs, sent_at, exc)
        named = rooms[0][0] if len(rooms) == 1 else f"{rooms[0][0]} and {len(rooms) - 1} more"
        raise backend_error(exc, named, None) from exc
    failed: Exception | None = None
    handed = 0
    next_due: list[tuple[str, int, int]] = []
    for n, ((key, _), answer) in enumerate(zip(rooms, answers, strict=True)):
        try:
            if isinstance(answer, Exception):
                raise backend_error(answer, key, None) from answer
            alive, found, next_ms = answer
            was = taken_ms if taken is None else taken[n]
            if alive and was is not None:
                next_due.append((key, was, next_ms))
            handed += handoffs.deliver(key, found, scripts)
            if not alive:
                index.drop(key)
        except Exception as exc:
            failed = failed or exc
    try:
        index.reschedule(next_due)
    except Exception as exc:  # the rooms stay due one interval on: swept sooner, not later
        failed = failed or exc
    if failed is not None:
        raise failed
    return handed
