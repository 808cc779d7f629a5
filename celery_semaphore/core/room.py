"""The waiting room, Python side: where the slots a release hands to parked waiters go.

A run that finds its key full can be *parked* (:meth:`Semaphore.park`) with an opaque
payload, the message that starts it again. A release then hands the freed slot to the oldest
parked waiter in the same script call: the slot stays held, reserved for that waiter, and
the releasing process publishes the payload (:class:`HandoffRoute`). The waiter's run claims
the reservation when it starts (:meth:`Semaphore.claim`); a reservation not claimed within
``claim_timeout`` lapses and its waiter goes back to the head of the room. The Lua side is
``lua/room.lua`` and the scripts that include it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import validation as check
from .scripts import Handoff

logger = logging.getLogger(__name__)

DEFAULT_CLAIM_TIMEOUT = 30.0
"""Seconds a hand-off's reservation waits for its run before it lapses."""
DEFAULT_HANDOFF_GRACE = 1.0
"""Seconds a reservation is kept for its run before a run that asks in person may take it.
Long enough that a burst's own messages, queued ahead of its first hand-offs, do not reorder
it (see the performance page); short enough that a reserved slot never idles for long behind
a broker backlog."""
DEFAULT_ROOM_TTL = 24 * 3600.0
"""Seconds an idle room (no park, no hand-off) lives before Redis expires it."""

Publisher = Callable[[str, Sequence[Handoff]], object]
"""``publish(key, handoffs)``: start the runs whose slots were just reserved."""


@dataclass(frozen=True)
class Waiter:
    """One parked waiter, as the room records it.

    Attributes:
        waiter (str): its id (a Celery task id).
        arrival (float): when it first asked, epoch seconds by the clock of the process
            that parked it.
        waited (float): seconds from ``arrival`` to the server's "now".
    """

    waiter: str
    arrival: float
    waited: float


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

    def deliver(self, key: str, handoffs: Sequence[Handoff]) -> None:
        """Hand ``handoffs`` to the publisher. Never raises: a failure is logged, and the
        reservations lapse and are handed out again."""
        if not handoffs:
            return
        if self.publisher is None:
            logger.warning(
                "semaphore %r: %d hand-off(s) with no publisher; they lapse after %.1fs",
                key,
                len(handoffs),
                self.claim_ms / 1000,
            )
            return
        try:
            self.publisher(key, handoffs)
        except Exception:
            logger.exception("semaphore %r: could not publish %d hand-off(s)", key, len(handoffs))
