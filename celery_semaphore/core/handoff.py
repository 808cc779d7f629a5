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
:func:`delivery`). If that round trip fails, the reservation lapses after its claim lease
and its room reserves it again (the waiter is first there), and whoever made that call
gathers it: so a lost gather costs at most one claim lease, as a lost publish does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Sequence

from . import validation as check
from .calls import Call, gather_call
from .feedback import DEFAULT_MAX_COOL_DOWN, Adaptive
from .names import Keys, room_index_of
from .replies import Handoff, SweepDue
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
SWEPT_WITHIN = 60.0
"""Seconds: a hand-off whose publish is lost with the process that released the slot is
handed out again within this, or the claim timeout when longer, after the release. The room
is swept at the first lease end its last sweep saw, no later than a lease after it for a
holder that renews; a holder whose lease is longer brings its room's sweep on to its
release's claim lease before it releases (:meth:`HandoffRoute.mark_before`)."""
MAX_GATHERS = 32
"""Gather calls one delivery makes at most (each may find more waiters to gather); past it
the rest lapse, and are reserved and gathered again after their claim lease."""


Step = Call[list[Handoff]] | SweepDue
"""What delivering hand-offs asks its caller to do with Redis: run a gather.lua call, or
score a room in the room index (``ZADD XX LT``)."""
Delivery = Generator[Step, "list[Handoff] | Exception | None", list[Handoff]]


def delivery(key: str, handoffs: Sequence[Handoff], claim_ms: int, gather: bool) -> Delivery:
    """How to deliver ``handoffs`` of ``key``, sans I/O, for the sync route and the asyncio
    one alike: yields each :data:`Step`, to be sent back its answer (a gather call's
    hand-offs; None for a room scored) or the redis-py error it met, and returns the
    hand-offs to publish. Rooms due sooner are scored first; waiters of several keys are
    gathered (when ``gather``: else they lapse, and are gathered again), at most
    :data:`MAX_GATHERS` calls. A failed step is logged: a room left as it was is swept when
    its score comes, and a reservation not gathered lapses and is gathered again."""
    ready: list[Handoff] = []
    pending = list(handoffs)
    gathers = 0
    while pending:
        for sweep in [h.sweep for h in pending if h.sweep is not None]:
            if isinstance((yield sweep), Exception):
                logger.warning("semaphore %r: could not bring its room's sweep on", key)
        ready += [h for h in pending if h.sweep is None and not h.gather]
        waiting = [h for h in pending if h.gather]
        if not gather or not waiting or gathers >= MAX_GATHERS:
            break
        gathers += 1
        answer = yield gather_call(waiting[0], claim_ms)
        if isinstance(answer, Exception):
            logger.warning(GATHER_FAILED, key, answer)
        pending = waiting[1:] + ([] if isinstance(answer, Exception) else answer or [])
    return ready


class HandoffRoute:
    """Where the hand-offs of one semaphore's releases go, and what its releases tell the
    store of how their runs went (see :meth:`LeaseRecord._verdict`).

    Args:
        claim_timeout (float): seconds a reservation waits for its run.
        publisher (Publisher | None): called with each batch of hand-offs; None leaves them
            to lapse and be handed out again by a sweep (a process that cannot publish).
        grace (float): seconds a reservation is kept for its run alone; after that, a run
            that asks for a slot in person (parks) takes it instead, and the passed-over
            waiter stays at the head of the room. 0: never.
        adaptive (Adaptive | None): the semaphore's adaptive limit, if it has one.
        max_cool_down (float): seconds: the longest cool-down a back-off may ask for.

    Raises:
        SemaphoreValidationError: ``claim_timeout`` or ``max_cool_down`` is not a positive
            number of seconds, or ``grace`` is negative.
    """

    def __init__(
        self,
        claim_timeout: float,
        publisher: Publisher | None,
        grace: float = DEFAULT_HANDOFF_GRACE,
        adaptive: Adaptive | None = None,
        max_cool_down: float = DEFAULT_MAX_COOL_DOWN,
    ) -> None:
        self.claim_ms = check.lease_ms(claim_timeout, "claim_timeout")
        self.publisher = check.check_callback(publisher, "on_handoff")
        self.grace_ms = round(check.check_delay(grace, "handoff_grace") * 1000)
        self.adaptive = "" if adaptive is None else adaptive.spec
        self.max_cool_down_ms = check.lease_ms(max_cool_down, "max_cool_down")

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
        """Hand ``handoffs`` to the publisher, gathered first (:meth:`gather`): how many it
        passed on. Never raises: a failure is logged, and the reservations lapse and are
        handed out again."""
        return self.publish(key, self.gather(key, handoffs, scripts))

    def gather(
        self, key: str, handoffs: Sequence[Handoff], scripts: Scripts | None
    ) -> list[Handoff]:
        """What to publish of ``handoffs`` (see :func:`delivery`): rooms due sooner scored
        and waiters of several keys gathered through ``scripts`` (None: they lapse and are
        gathered again). Never raises."""
        steps = delivery(key, handoffs, self.claim_ms, None not in (scripts, self.publisher))
        answer: list[Handoff] | Exception | None = None
        while True:
            try:
                step = steps.send(answer)
            except StopIteration as done:
                return list(done.value)
            try:
                if isinstance(step, SweepDue):
                    answer = None
                    if scripts is not None:
                        scripts.client.zadd(step.index, {step.key: step.due_ms}, xx=True, lt=True)
                else:
                    answer = scripts.run(step) if scripts is not None else []
            except REDIS_ERRORS as exc:
                answer = exc

    def publish(self, key: str, handoffs: Sequence[Handoff]) -> int:
        """Hand ``handoffs`` (gathered) to the publisher: how many. Never raises."""
        if not handoffs:
            return 0
        if self.publisher is None:
            logger.warning(
                "semaphore %r: %d hand-off(s) with no publisher; they lapse after %.1fs",
                key,
                len(handoffs),
                self.claim_ms / 1000,
            )
        else:
            try:
                self.publisher(key, handoffs)
            except Exception:
                logger.exception(
                    "semaphore %r: could not publish %d hand-off(s)", key, len(handoffs)
                )
        return len(handoffs)
