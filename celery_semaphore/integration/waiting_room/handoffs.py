"""Hand-offs, Celery side: publish the message of a run whose slot a release or sweep just
reserved, and claim that slot when the run starts.

A release (or a sweep, or a raised live limit) reserves a freed slot for the oldest parked
run in the same script call and hands this process the run's payload: its message as
Celery's ``retry()`` would publish it (see :mod:`.parking`). :func:`publisher_for` publishes
it with a fresh :data:`~celery_semaphore.integration.shedding.HANDOFF_ID_HEADER`, to the
run's hand-off queue (see :mod:`.queues`); the run then calls :func:`claim_or_end` when it
starts.
"""

from __future__ import annotations

import atexit
import collections
import logging
import time
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from celery import Celery, Task
from celery.exceptions import Ignore
from celery.signals import task_received

from ...core.group import SlotGroup
from ...core.handoff import Publisher
from ...core.replies import Handoff, NotWaiting, Parked
from ...core.semaphore import Semaphore
from ...core.slot import Slot
from ..settings import app_settings, client_for, forget
from ..shedding import GIVE_UP_HEADER, HANDOFF_HEADER, HANDOFF_ID_HEADER, HANDOFF_QUEUE_HEADER
from ..signals import task_label
from ..stats import bump
from .parking import INCARNATION_HEADER, has_ended, message_of, stamp_of
from .queues import handoff_queue

logger = logging.getLogger(__name__)

DUE_HEADER = "semaphore_due_ms"
"""An eta'd hand-off's instant (epoch ms, the store's clock) and the eta it was published
with (epoch ms, the publisher's), as ``"<instant> <eta>"``: only that eta is re-timed, not
the eta of a message that copied the header (a ``retry()`` from the run's body)."""

_PUBLISHED: collections.deque[Any] = collections.deque(maxlen=4096)
"""The AsyncResults of this process's latest hand-off publishes (see :func:`publisher_for`)."""


def forget_published() -> None:
    """Drop the kept AsyncResults without letting them talk to their result backends, which
    may be gone (a test's server, a closed connection) and would then be retried at length.

    Registered to run at exit, while Celery's modules still stand: collected during
    interpreter teardown instead, each would print a TypeError from its ``__del__``.
    """
    for result in _PUBLISHED:
        result.backend = None  # AsyncResult.__del__ does nothing without a backend
    _PUBLISHED.clear()


atexit.register(forget_published)


def is_handoff(request: Any) -> bool:
    """Whether this delivery was published by a hand-off for this very attempt."""
    mark = (request.headers or {}).get(HANDOFF_HEADER)
    return mark is not None and mark == (request.retries or 0)


def is_give_up(request: Any) -> bool:
    """Whether this delivery was published by a sweep because the run's deadline (its
    ``queue_timeout``, or its ``expires``) passed while it was parked."""
    return bool((request.headers or {}).get(GIVE_UP_HEADER)) and is_handoff(request)


def publisher_for(app: Celery, handoff_queues: bool = True) -> Publisher:
    """``on_handoff`` for ``app``'s semaphores: publish each handed-off run's message.

    Args:
        app (Celery): the app whose tasks' runs are handed off.
        handoff_queues (bool): publish each run to the hand-off queue its payload names, if
            any (a release's hand-off, meant to be fetched at once); False: to the run's own
            queue, which the sweeps use, so that a run whose hand-off queue nobody consumes
            any more (its last worker stopped, or ``semaphore_handoff_queues`` turned off)
            still reaches a worker once its reservation lapses.
    """

    def publish(key: str, handoffs: Sequence[Handoff]) -> None:
        priority = app_settings(app).handoff_priority
        for handoff in handoffs:
            signature = app.signature(message_of(handoff.payload))
            headers = signature.options.setdefault("headers", {})
            headers[HANDOFF_ID_HEADER] = uuid.uuid4().hex
            if handoff.give_up:
                headers[GIVE_UP_HEADER] = True
            if priority is not None:
                signature.options["priority"] = priority
            # A start rate's instant: the worker holds the run until then. One less than a
            # second away goes without an eta: native delayed delivery (quorum queues) turns
            # an eta into whole seconds and refuses 0, and the claim waits for the instant
            # by the store's clock all the same. The eta is the instant on this host's clock
            # (Celery turns it into a broker delay with this clock); the worker that fetches
            # it holds it by its own, corrected from the header (see _on_the_stores_clock).
            due = handoff.start_ms / 1000 + store_clock_offset(app)
            if due > time.time() + 1:
                headers[DUE_HEADER] = f"{handoff.start_ms} {round(due * 1000)}"
                signature.options.pop("countdown", None)
                signature.options["eta"] = datetime.fromtimestamp(due, timezone.utc)
            lane = headers.get(HANDOFF_QUEUE_HEADER)
            if handoff_queues and isinstance(lane, str):
                signature.options["queue"] = handoff_queue(app, lane)
                for routing in ("exchange", "routing_key"):
                    signature.options.pop(routing, None)
            # Celery before 5.5 stops listening for a task's result when any AsyncResult of
            # that id is collected, including a get() waiting in this process: keep ours.
            _PUBLISHED.append(signature.apply_async())
            logger.debug(
                "semaphore %r: %s task %s",
                key,
                "gave up" if handoff.give_up else "handed a slot to",
                handoff.waiter,
            )

    return publish


def store_clock_offset(app: Celery) -> float:
    # How many seconds this host's clock is ahead of the app's store's (behind: below 0),
    # measured by one TIME at most once a minute per process: a clock stepped by NTP since
    # is followed within the minute.
    minute, measured = int(time.monotonic() // 60), app.__dict__.get("_semaphore_clock")
    if measured is None or measured[0] != minute:
        offset = measured[1] if measured else 0.0
        try:
            seconds, micros = client_for(app).time()
            offset = time.time() - seconds - micros / 1e6
        except Exception as exc:  # out of reach: the last offset (or none), with no new try
            # for a minute, so neither a publish nor the worker's main loop waits on it
            logger.debug("the store's clock is unknown for now: %r", exc)
        measured = app.__dict__["_semaphore_clock"] = (minute, offset)
    return float(measured[1])


@task_received.connect  # type: ignore[untyped-decorator]
def _on_the_stores_clock(request: Any, **_: Any) -> None:
    # Celery holds a message with an eta until then by the clock of the worker that fetched
    # it, so a publisher or a worker whose clock is off would start a hand-off early (its
    # claim then waits, holding a pool process) or late by as much. Sent before Celery reads
    # the eta: it becomes the instant by the store's clock, on this host's (an error here is
    # logged by Celery's signal, and the eta stays as published). A message that copied
    # the header (a retry() from the body) has an eta of its own: it is left alone.
    instant, _space, eta = str(request.request_dict.get(DUE_HEADER, "")).partition(" ")
    if eta and request.eta is not None and abs(request.eta.timestamp() * 1000 - int(eta)) < 1:
        request._eta = datetime.fromtimestamp(
            int(instant) / 1000 + store_clock_offset(request.task.app), timezone.utc
        )


def claim_or_end(
    task: Task,
    semaphore: Semaphore,
    key: str,
    limit: int,
    weight: int,
    metadata: dict[str, Any],
    many: Sequence[tuple[str, int, int]] | None = None,
) -> Slot | SlotGroup | None:
    """Claim the slot a hand-off reserved for the running task, or end the run.

    With ``many`` (``(key, limit, weight)`` of each of several keys), the run claims them
    all (see :meth:`Semaphore.claim_many`).

    Returns:
        Slot | SlotGroup | None: the reserved slot; or None when this very message claimed the slot
        before and the broker delivers it again (its run was lost after the claim, say a
        worker killed with ``acks_late``): it is a new run, and asks for a slot as any run
        does. The same message while that run still holds its slot and renews it, or once
        its result is stored, is a copy (a Redis broker's visibility timeout), and ends
        quietly (it waits in this process for the slot's next renewal or end: at most one
        renewal interval, or a lease for a lost run); so does another copy of a hand-off (a
        stranded prefetch, a sweep's second publish), which carries another id.

    Raises:
        celery.exceptions.Ignore: the reservation lapsed and the run is parked again (its
            next hand-off starts it), or there was nothing to claim (a duplicate delivery,
            whose task already ran or runs elsewhere).
    """
    delivery = str((task.request.headers or {}).get(HANDOFF_ID_HEADER) or "")
    result: Slot | SlotGroup | Parked | NotWaiting = (
        semaphore.room.claim_many(many, task.request.id, metadata=metadata, delivery=delivery)
        if many
        else semaphore.room.claim(
            key, task.request.id, limit=limit, weight=weight, metadata=metadata, delivery=delivery
        )
    )
    if isinstance(result, (Slot, SlotGroup)):
        forget(task.app, task.request.id)  # out of the room: nothing for the journal
        # A run parked in an older incarnation of the store (one restored from a snapshot,
        # say) may have run since, in the store that was lost: the result backend says.
        stamp = (task.request.headers or {}).get(INCARNATION_HEADER)
        if stamp == stamp_of(semaphore) or not has_ended(task.app, task.request.id):
            return result
        result.release()
        logger.warning(
            "%sa hand-off of semaphore %r reached a run that already ran (the store came back "
            "from before it ran: an older snapshot, a failover); its slot goes on, unused",
            task_label(task), key,
        )  # fmt: skip
        raise Ignore()
    if isinstance(result, NotWaiting):
        # The broker delivers a message again when the run it started was lost (its worker
        # died): the claim it made is then on record, unless the store lost the record in a
        # restart, when the broker's own word is all there is. A Redis broker also restores
        # a message held past its visibility timeout (for a start rate's instant, say): a
        # copy whose run still holds its slot (``running``), or ended since (the result
        # backend says so), is not run twice.
        redelivered = bool((task.request.delivery_info or {}).get("redelivered"))
        # The same message while the slot its first delivery's run took is still held: a
        # copy, if that run renews it (it ends here); a redelivery after that run was lost,
        # if the slot lapses or is freed (a dead pool process's, say). A run that gave its
        # slot back stores its result a moment later: wait for it (3 s).
        if (
            not (result.holder and semaphore.room.outlives(key, result.holder))
            and (result.again or (redelivered and not result.recorded))
            and not has_ended(task.app, task.request.id, 3.0 if result.holder else 0.0)
        ):
            return None
        logger.info(
            "%sa hand-off of semaphore %r finds nothing to claim (another copy claimed it, "
            "or the store lost it and this host's journal sends the run again); it ends here",
            task_label(task), key,
        )  # fmt: skip
    bump(task.app, task.request.hostname, "handoffs_missed")
    raise Ignore()
