"""What the scripts answer: small typed results, and the pure functions that read a raw
reply into them.

The functions take a reply as redis-py returns it (RESP2 or RESP3, bytes or decoded text)
and do no I/O, so the sync and the asyncio clients read every reply the same way (see
:class:`~celery_semaphore.core.scripts.Call`). Each script's reply is described in the
contract that opens its ``lua/*.lua`` file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class SweepDue:
    """A room whose next sweep must come by ``due_ms`` (epoch ms; 0: now), sooner than its
    last sweep scored it for: a release that left a freed slot to the sweep (its caller
    cannot publish), a raised limit, or a reservation that lapses before the room's next
    sweep (room.lua's ``room_bring_on``). The room index lives apart from the room (on a
    cluster, on another node), so no script can write it: the caller scores ``key`` in
    ``index`` with ``ZADD XX LT`` (see :func:`.handoff.delivery`)."""

    index: str
    due_ms: int
    key: str


@dataclass(frozen=True)
class Handoff:
    """A slot reserved for a parked waiter, whose payload the caller must now publish; or,
    with ``give_up``, a waiter past its deadline, whose run must now cancel itself and fail.

    With ``gather`` (the slots keys of every key it needs), a waiter of several keys was
    given a reservation of one of them: not to be published, but gathered (gather.lua),
    which hands it off once it holds all of them (see :class:`~.handoff.HandoffRoute`)."""

    waiter: str
    payload: bytes
    give_up: bool = False
    gather: tuple[str, ...] = ()
    start_ms: int = 0
    """When the run may start, epoch ms by the store's clock (a start rate's instant; 0:
    now): publish it to start then."""
    sweep: SweepDue | None = None
    """Not a run to start: its room's next sweep is due sooner (``waiter`` is empty)."""


@dataclass(frozen=True)
class Parked:
    """park.lua parked the waiter: ``position`` older waiters are ahead of it; ``limit`` is
    the key's limit that applied (a live one, when set). From park_many.lua, ``index`` is the
    (1-based) key whose room it waits in, and ``limit`` that key's."""

    position: int
    now_ms: int
    limit: int = 0
    index: int = 0


@dataclass(frozen=True)
class RoomFull:
    """park.lua refused: the room already holds ``queued`` waiters (``max_queued``)."""

    queued: int


@dataclass(frozen=True)
class Early:
    """claim.lua: the waiter's reservation is for a start rate's instant,
    ``wait_ms`` from now (its run came early: its clock is ahead of the server's)."""

    wait_ms: int


@dataclass(frozen=True)
class NotWaiting:
    """claim.lua: nothing is reserved or parked for the waiter. ``again`` when
    the claiming delivery is the one that claimed its slot before (its run was lost);
    ``recorded`` False when no claim of the waiter is on record at all (it left the room
    without one, or the store lost the record in a restart)."""

    again: bool = False
    recorded: bool = True
    holder: str = ""
    """With ``again``: the token of the slot the run that delivery started took, while it is
    still held: a copy of the message (a Redis broker restores one held past its visibility
    timeout) if that run renews it, a redelivery after the run was lost if it lapses or is
    freed (see :meth:`.room.WaitingRoom.outlives`)."""


@dataclass(frozen=True)
class Admitted:
    """acquire.lua took a slot (or found the token already holding one) under ``limit``, the
    key's limit that applied (a live one, when set). From park.lua, ``roomless`` says the
    key had no waiting room at all (the waiter took a free slot without joining one)."""

    expires_at_ms: int
    now_ms: int
    limit: int = 0
    roomless: bool = False


@dataclass(frozen=True)
class Declined:
    """take.lua found a room on the key, or no free slot (or the token there already), and
    did nothing: the caller parks with its payload instead."""


MIN_BLOCK = 0.01
"""Shortest BLPOP timeout a waiter sends, seconds. Redis 6.2 turns a timeout into whole
milliseconds by truncating, so 0.001 s can become 0, which means "block until a push": a
waiter with its last fraction of a millisecond left then blocked until its socket timed out.
Redis 6.2 times blocked calls out on its 100 ms tick anyway."""


@dataclass(frozen=True)
class Full:
    """acquire.lua found every slot held by ``holders`` live holders, the first of whose
    leases lapses at ``first_expiry_ms`` (epoch ms); ``limit`` is the limit that applied."""

    holders: int
    now_ms: int
    first_expiry_ms: int
    limit: int = 0
    start_ms: int = 0
    """When a start rate allows the call (epoch ms), if a rate refused it; 0: the slots."""

    def first_lapse(self, now_ms: int, within: float) -> float:
        """Seconds a caller that waits blocks for: from ``now_ms`` (epoch ms) until the
        soonest lease lapses (no unit held: a weight above a lowered live limit, which no
        lapse frees, only a release elsewhere or a raised limit, both of which wake the
        caller), or, refused by a rate, until the rate allows the call; at most ``within``
        seconds, and at least :data:`MIN_BLOCK`."""
        until_ms = self.start_ms or self.first_expiry_ms
        lapse = (until_ms - now_ms) / 1000 if until_ms else math.inf
        return max(MIN_BLOCK, min(within, lapse))


def _handoffs(reply: Any, start: int, give_up: bool = False) -> list[Handoff]:
    """The {waiter, payload} pairs at ``reply[start:]``, the one reading of what room.lua's
    steps hand out: a waiter written ``!<waiter>`` has its keys (a JSON list) in place of a
    payload, to be gathered (see room.lua), one written ``><start_ms>|<waiter>`` may start
    only then (a start rate's instant), and ``~sweep`` is a room whose sweep is due sooner
    (its payload: the room index's key, the due time and the semaphore key)."""
    found = []
    for i in range(start, len(reply) - 1, 2):
        waiter, payload = _text(reply[i]), reply[i + 1]
        payload = payload if isinstance(payload, bytes) else str(payload).encode()
        if waiter == "~sweep":
            index, due, key = payload.decode().split(" ", 2)  # the key last: it may hold spaces
            found.append(Handoff("", b"", sweep=SweepDue(index, int(due), key)))
        elif waiter.startswith("!"):
            found.append(Handoff(waiter[1:], b"", gather=tuple(json.loads(payload))))
        elif waiter.startswith(">"):  # ">" <epoch ms> "|" <waiter>: a start rate's instant
            at, _, waiter = waiter[1:].partition("|")
            found.append(Handoff(waiter, payload, give_up, start_ms=int(at)))
        else:
            found.append(Handoff(waiter, payload, give_up))
    return found


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def parse_acquire(reply: Any, limit: int, lease_ms: int) -> Admitted | Full:
    """acquire.lua's reply as :class:`Admitted` or :class:`Full`, for a call that gave
    ``limit`` and ``lease_ms``: its common answer, a bare ``now_ms``, stands for a new slot
    under that limit and lease."""
    if isinstance(reply, int):
        return Admitted(reply + lease_ms, reply, limit)
    if int(reply[0]) == 1:
        return Admitted(int(reply[1]), int(reply[2]), int(reply[3]))
    start = int(reply[5]) if len(reply) > 5 else 0
    return Full(int(reply[1]), int(reply[2]), int(reply[3]), int(reply[4]), start)


def parse_acquire_many(reply: Any) -> list[Admitted] | tuple[int, Full]:
    """acquire_many.lua's reply: an :class:`Admitted` per key, or the (0-based) index of the
    first key too full, with its :class:`Full`."""
    if int(reply[0]) == 1:
        expires, now = int(reply[1]), int(reply[2])
        return [Admitted(expires, now, int(limit)) for limit in reply[3:]]
    return int(reply[1]) - 1, Full(int(reply[2]), int(reply[3]), int(reply[4]), int(reply[5]))


def parse_extend(reply: Any) -> list[int | None]:
    """extend.lua's reply: each renewal's new expiry (epoch ms), or None when it is gone."""
    return [int(expiry) or None for expiry in reply[1:]]


class Released(NamedTuple):
    """release.lua's (and recover.lua's) reply: whether the slot was ours until now, the
    hand-offs, and after a back-off when its cool-down ends (epoch ms; else 0)."""

    owned: bool
    handed: list[Handoff]
    cooling_until_ms: int = 0


def parse_release(reply: Any) -> Released:
    """release.lua's (and recover.lua's) reply (see :class:`Released`): a bare flag when it
    handed nothing off; after a back-off, the cool-down's end right after the flag."""
    if isinstance(reply, int):
        return Released(reply == 1, [])
    if len(reply) % 2 == 0:  # the flag, the cool-down's end, then hand-offs in pairs
        return Released(int(reply[0]) == 1, _handoffs(reply, 2), int(reply[1]))
    return Released(int(reply[0]) == 1, _handoffs(reply, 1))


def parse_cancel(reply: Any) -> tuple[bool, list[Handoff], tuple[str, ...]]:
    """cancel.lua's reply: the flag and the hand-offs; or, for a waiter of several keys that
    was not cancelled yet, the slots keys of all of them (to cancel it with)."""
    if int(reply[0]) == -1:
        return False, [], tuple(json.loads(reply[1]))
    return int(reply[0]) == 1, _handoffs(reply, 1), ()


def parse_gather(reply: Any) -> list[Handoff]:
    """gather.lua's reply: the hand-offs."""
    return _handoffs(reply, 0)


def parse_take(reply: Any, limit: int, lease_ms: int) -> Admitted | Declined:
    """take.lua's reply, for a call that gave ``limit`` and ``lease_ms`` (a bare ``now_ms``:
    a new slot under them; 0: nothing was done)."""
    if isinstance(reply, int):
        return Admitted(reply + lease_ms, reply, limit, roomless=True) if reply else Declined()
    return Admitted(int(reply[1]), int(reply[2]), int(reply[3]), roomless=True)


def parse_park(
    reply: Any, limit: int, lease_ms: int
) -> tuple[Admitted | Parked | RoomFull, list[Handoff]]:
    """park.lua's reply, for a call that gave ``limit`` and ``lease_ms``: what became of
    the waiter, and the hand-offs (a bare ``now_ms`` or a status 2: a free slot of a key
    with no room, taken without joining it)."""
    if isinstance(reply, int):
        return Admitted(reply + lease_ms, reply, limit, roomless=True), []
    status, value, now_ms, limit = (int(v) for v in reply[:4])
    result: Admitted | Parked | RoomFull
    if status > 0:
        result = Admitted(value, now_ms, limit, roomless=status == 2)
    elif status == 0:
        result = Parked(value, now_ms, limit)
    else:
        result = RoomFull(value)
    return result, _handoffs(reply, 4)


def parse_claim(reply: Any) -> tuple[Admitted | Parked | NotWaiting | Early, list[Handoff]]:
    """claim.lua's reply: what became of the waiter's run, and the hand-offs."""
    status, value, now_ms, limit = (int(v) for v in reply[:4])
    if status == 1:
        return Admitted(value, now_ms, limit), _handoffs(reply, 4)
    if status == 0:
        return Parked(value, now_ms, limit), _handoffs(reply, 4)
    if int(reply[4]) > 0:
        return Early(int(reply[4])), []
    holder = _text(reply[5]) if value == 3 else ""
    return NotWaiting(again=value in (1, 3), recorded=value != 2, holder=holder), []


def parse_set_limit(reply: Any) -> tuple[int | None, int, list[Handoff]]:
    """set_limit.lua's reply: the live limit before (None: none), the server's time, and
    the hand-offs."""
    return int(reply[0]) or None, int(reply[1]), _handoffs(reply, 3)


def parse_pause(reply: Any) -> tuple[bool, list[Handoff]]:
    """set_limit.lua's reply to a pause or a resume: whether the key was paused before, and
    the hand-offs (a resume hands the free capacity out)."""
    return int(reply[2]) == 1, _handoffs(reply, 3)


def parse_park_many(
    reply: Any,
) -> tuple[Admitted | Parked | RoomFull | NotWaiting, list[Handoff]]:
    """park_many.lua's reply, read as park.lua's; a :class:`Parked` carries the index of the
    key whose room the waiter is in (its ``limit`` is left 0)."""
    status, value, now_ms, index = (int(v) for v in reply[:4])
    result: Admitted | Parked | RoomFull | NotWaiting
    if status == 1:
        result = Admitted(value, now_ms)
    elif status == 0:
        result = Parked(value, now_ms, 0, index)
    elif status == -1:
        result = RoomFull(value)
    else:
        result = NotWaiting(again=value == 1, recorded=value != 2)
    return result, _handoffs(reply, 4)


def parse_waiting(reply: Any) -> tuple[int, int, list[tuple[str, int]]]:
    """waiting.lua's reply: the server's time, how many are parked, the rows listed."""
    rows = [(_text(reply[i]), int(reply[i + 1])) for i in range(2, len(reply) - 1, 2)]
    return int(reply[0]), int(reply[1]), rows


def parse_sweep(reply: Any) -> tuple[bool, list[Handoff], int]:
    """sweep.lua's reply: whether the room still exists, its hand-offs and give-ups, and
    when it next needs a sweep (epoch ms by the server's clock; -1: never, it is gone)."""
    alive, handed, give_ups, next_ms = reply
    found = _handoffs(handed, 0) + _handoffs(give_ups, 0, give_up=True)
    return int(alive) == 1, found, int(next_ms)


def parse_held(reply: Any) -> list[bool]:
    """held.lua's reply: whether each token asked about is a live holder."""
    return [int(value) == 1 for value in reply]


def parse_holders(reply: Any) -> tuple[int, list[tuple[str, int, str]]]:
    """holders.lua's reply: the server's time and each ``(token, expires_at_ms, info)``."""
    rows = [
        (_text(reply[i]), int(reply[i + 1]), _text(reply[i + 2])) for i in range(1, len(reply), 3)
    ]
    return int(reply[0]), rows


@dataclass(frozen=True)
class Waiter:
    """One parked waiter, as the room records it.

    Attributes:
        waiter (str): its id (a Celery task id).
        arrival (float): when it first asked, epoch seconds: by the server's clock (a park
            that gave ``waited`` or nothing), or by the parking process's (an ``arrival``).
        waited (float): seconds from ``arrival`` to the server's "now".
    """

    waiter: str
    arrival: float
    waited: float


@dataclass(frozen=True)
class DueRooms:
    """due_rooms.lua's reply: the rooms handed to this caller to sweep, now theirs until
    one interval from ``now_ms``.

    Attributes:
        keys (tuple[str, ...]): the semaphore keys whose rooms to sweep, most overdue first.
        now_ms (int): the server's time, epoch ms.
        next_ms (int): when the earliest room left in the index is due, epoch ms (at most
            ``now_ms`` when more were due than the call took); -1 when the index is empty.
        taken_ms (int): the score each room taken was given (``now_ms`` + the interval),
            which its sweep's score replaces unless a mark lowered it since; -1: not known.
    """

    keys: tuple[str, ...]
    now_ms: int
    next_ms: int
    taken_ms: int = -1


def parse_due_rooms(reply: Any) -> DueRooms:
    """due_rooms.lua's reply as :class:`DueRooms`."""
    return DueRooms(tuple(_text(key) for key in reply[2:]), int(reply[0]), int(reply[1]))
