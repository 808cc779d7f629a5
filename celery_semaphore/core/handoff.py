"""Where the slots a release hands to parked waiters go: :class:`HandoffRoute`.

A release (or a sweep, a cancel, a raised live limit) that frees a slot of a key with parked
waiters reserves it for the oldest in the same script call, and answers with the waiters'
payloads. Whoever made the call passes them to the route's publisher, which starts the
waiters' runs again; each run then claims its reservation (see
:class:`~celery_semaphore.core.room.WaitingRoom`). A reservation not claimed within
``claim_timeout`` lapses and its waiter goes back to the head of the room.

A waiter that needs several keys waits in the room of each, and a room that reserves its
units for it answers a :class:`Handoff` with ``gather`` instead of its payload: the route
first runs gather.lua with all of its keys (one more round trip, by the caller that got the
answer), which hands it off once each key holds a reservation for it (see
:class:`Gathering`). If that round trip fails, the reservation lapses after its claim lease
and its room reserves it again (the waiter is first there), and whoever made that call
gathers it: so a lost gather costs at most one claim lease, as a lost publish does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

from . import validation as check
from .calls import Call, gather_call
from .names import Keys, room_index_of
from .replies import Handoff
from .scripts import REDIS_ERRORS, Scripts

logger = logging.getLogger(__name__)

DEFAULT_CLAIM_TIMEOUT = 30.0
"""Seconds a hand-off's reservation waits for its run before it lapses."""
DEFAULT_HANDOFF_GRACE = 1.0
"""Seconds a reservation is kept for its run before a run that asks in person may take it.
Long enough that a burst's own messages, queued ahead of its first hand-offs, do not reorder
it (see the performance page); short enough that a reserved slot never idles for long behind
a broker backlog."""
Publisher = Callable[[str, Sequence[Handoff]], object]
"""``publish(key, handoffs)``: start the runs whose slots were just reserved."""
GATHER_FAILED = (
    "semaphore %r: could not gather a waiter of several keys: %s; its reservation lapses "
    "and is gathered again"
)
SWEEP_DUE = "~sweep"
"""The waiter of the mark a script answers beside its hand-offs when the room's next sweep
must come sooner than its last sweep scored it for: a release that left a freed slot to the
sweep (its caller cannot publish), a raised limit, or a reservation that lapses before the
room's next sweep (room.lua's ``room_bring_on``). Its payload is the room index's key, when
the sweep is due (epoch ms; 0: now) and the semaphore key, space-separated: see
:func:`sweep_soon`."""


def sweep_mark(payload: bytes) -> tuple[str, int, str]:
    """The room index's key, the due time (epoch ms, 0: now) and the semaphore key a
    :data:`SWEEP_DUE` mark carries (the key last: it may hold spaces)."""
    index, due, key = payload.decode().split(" ", 2)
    return index, int(due), key


SWEPT_WITHIN = 60.0
"""Seconds: a hand-off whose publish is lost with the process that released the slot is
handed out again within this, or the claim timeout when longer, after the release. The room
is swept at the first lease end its last sweep saw, no later than a lease after it for a
holder that renews; a holder whose lease is longer brings its room's sweep on to its
release's claim lease before it releases (:meth:`HandoffRoute.mark_before`)."""
MAX_GATHERS = 32
"""Gather calls one delivery makes at most (each may find more waiters to gather); past it
the rest lapse, and are reserved and gathered again after their claim lease."""


def sweep_soon(key: str, handoffs: Sequence[Handoff], scripts: Scripts | None) -> list[Handoff]:
    """``handoffs`` less the :data:`SWEEP_DUE` marks, whose room is made due for a sweep no
    later than they say (one ``ZADD XX LT`` on the room index each, through ``scripts``'
    client). Never raises: a room left as it was is swept when its score comes (see
    sweep.lua for how late that may be)."""
    marks = [h for h in handoffs if h.waiter == SWEEP_DUE]
    if not marks:
        return list(handoffs)
    if scripts is not None:
        try:
            for mark in marks:
                index, due, room = sweep_mark(mark.payload)
                scripts.client.zadd(index, {room: due}, xx=True, lt=True)
        except REDIS_ERRORS as exc:
            logger.warning("semaphore %r: could not bring its room's sweep on: %s", key, exc)
    return [h for h in handoffs if h.waiter != SWEEP_DUE]


class Gathering:
    """The hand-offs of one call, its waiters of several keys gathered first: each one's
    gather.lua call (:meth:`next_call`) answers hand-offs to publish, and maybe more waiters
    to gather (:meth:`add`). The sync route and the asyncio one run the calls.

    Args:
        handoffs (Sequence[Handoff]): what the call answered.
        claim_ms (int): the claim lease of a waiter handed off now.
    """

    def __init__(self, handoffs: Sequence[Handoff], claim_ms: int) -> None:
        self.claim_ms = claim_ms
        self.ready: list[Handoff] = []
        self._pending: list[Handoff] = []
        self._calls = 0
        self.add(handoffs)

    def add(self, handoffs: Sequence[Handoff]) -> None:
        """Hand-offs to publish, and waiters to gather."""
        for handoff in handoffs:
            (self._pending if handoff.gather else self.ready).append(handoff)

    def next_call(self) -> Call[list[Handoff]] | None:
        """The next gather.lua call to run, or None when none is left (or enough were run)."""
        if not self._pending or self._calls >= MAX_GATHERS:
            return None
        self._calls += 1
        return gather_call(self._pending.pop(0), self.claim_ms)


class HandoffRoute:
    """Where the hand-offs of one semaphore go.

    Args:
        claim_timeout (float): seconds a reservation waits for its run.
        publisher (Publisher | None): called with each batch of hand-offs; None leaves them
            to lapse and be handed out again by a sweep (a process that cannot publish).
        grace (float): seconds a reservation is kept for its run alone; after that, a run
            that asks for a slot in person (parks) takes it instead, and the passed-over
            waiter stays at the head of the room. 0: never.

    Raises:
        SemaphoreValidationError: ``claim_timeout`` is not a positive number of seconds,
            or ``grace`` is negative.
    """

    def __init__(
        self,
        claim_timeout: float,
        publisher: Publisher | None,
        grace: float = DEFAULT_HANDOFF_GRACE,
    ) -> None:
        self.claim_ms = check.lease_ms(claim_timeout, "claim_timeout")
        self.publisher = check.check_callback(publisher, "on_handoff")
        self.grace_ms = round(check.check_delay(grace, "handoff_grace") * 1000)

    @property
    def release_claim_ms(self) -> int:
        """The claim lease for release.lua: 0 (hand nothing off) with no publisher, so the
        freed slot stays free for the next sweep (run by a process that can publish) to hand
        out, rather than sit reserved for a run nobody starts."""
        return self.claim_ms if self.publisher is not None else 0

    def mark_before(
        self, keys: Keys, key: str, lease: float = math.inf
    ) -> tuple[str, dict[str, int]]:
        """What a call that may free slots of ``key`` (the release of a slot leased for
        ``lease`` seconds; an operator's change, by default) writes to the room index before
        it runs, as ``ZADD <index> XX LT <mapping>``: its room, if it has one, due no later
        than the claim lease of a reservation the call may make (by this host's clock).
        Nothing (an empty mapping) for a lease no longer than :data:`SWEPT_WITHIN` or the
        claim timeout: see there. The mark the call's own script answers is written after
        it, and would be lost with a process that died in between."""
        if lease * 1000 <= max(SWEPT_WITHIN * 1000, self.claim_ms):
            return "", {}
        return room_index_of(keys.slots), {key: int(time.time() * 1000) + self.claim_ms}

    def deliver(self, key: str, handoffs: Sequence[Handoff], scripts: Scripts | None = None) -> int:
        """Hand ``handoffs`` to the publisher, those of waiters of several keys gathered first
        through ``scripts`` (None: they lapse and are gathered again): how many it passed on.
        Never raises: a failure is logged, and the reservations lapse and are handed out
        again."""
        handoffs = sweep_soon(key, handoffs, scripts)
        if any(handoff.gather for handoff in handoffs):
            handoffs = self.gather(key, handoffs, scripts)
        if not handoffs:
            return 0
        if self.publisher is None:
            logger.warning(
                "semaphore %r: %d hand-off(s) with no publisher; they lapse after %.1fs",
                key,
                len(handoffs),
                self.claim_ms / 1000,
            )
            return len(handoffs)
        try:
            self.publisher(key, handoffs)
        except Exception:
            logger.exception("semaphore %r: could not publish %d hand-off(s)", key, len(handoffs))
        return len(handoffs)

    def gather(
        self, key: str, handoffs: Sequence[Handoff], scripts: Scripts | None
    ) -> list[Handoff]:
        """``handoffs`` with their waiters of several keys gathered (see :class:`Gathering`)
        through ``scripts``: what to publish. Never raises."""
        found = Gathering(handoffs, self.claim_ms)
        if scripts is None or self.publisher is None:
            return found.ready
        while (call := found.next_call()) is not None:
            try:
                handed: list[Handoff] = scripts.run(call)
            except REDIS_ERRORS as exc:
                logger.warning(GATHER_FAILED, key, exc)
                continue
            found.add(sweep_soon(key, handed, scripts))
        return found.ready
