"""The message headers of the waiting room: what a hand-off's message carries so that the
run it starts knows it was handed a slot, by which publish, and where hand-offs of it go.

The shed headers, which a parked run also carries to keep its first arrival, are in
:mod:`~celery_semaphore.integration.shedding`.
"""

from __future__ import annotations

HANDOFF_HEADER = "semaphore_handoff"
"""Message header of a run started by a hand-off of the waiting room: the attempt
(``request.retries``) it was parked in. Only that attempt claims a reservation; a retry the
task asks for itself carries the header on with a higher ``retries`` and is a new run."""

HANDOFF_ID_HEADER = "semaphore_handoff_id"
"""Message header: a fresh id for each publish of a hand-off, recorded when its run claims
the slot, so that the broker delivering the same message again (the run was lost) is told
from another copy of it (a duplicate, which ends quietly)."""

GIVE_UP_HEADER = "semaphore_give_up"
"""Message header of a parked run whose ``queue_timeout`` passed while it waited: the run
takes itself out of the room and fails instead of running."""

HANDOFF_QUEUE_HEADER = "semaphore_handoff_queue"
"""Message header of a parked run's payload: the hand-off queue of the queue it came from
(see :mod:`~celery_semaphore.integration.waiting_room.queues`), which a release publishes
its hand-off to; the message's own routing is the run's own queue, which a sweep uses."""

HANDOFF_HEADERS = frozenset((HANDOFF_HEADER, HANDOFF_ID_HEADER, GIVE_UP_HEADER,
                             HANDOFF_QUEUE_HEADER))  # fmt: skip
"""The marks of one delivery, which a message published again (shed or parked) leaves out."""
