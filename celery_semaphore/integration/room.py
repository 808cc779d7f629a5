"""The waiting room, Celery side: park a run that found its key full, and start it again
the moment a release hands it a slot.

With ``on_full="queue"`` a run that finds every slot held is parked in the key's room (see
:mod:`celery_semaphore.core.room`) with its message, as Celery's own ``retry()`` would
publish it, and ends with its state left as it was (PENDING, or STARTED with
``task_track_started``): it has not run yet. When a holder releases, the same script call reserves
the slot for the oldest parked run and the releasing process publishes that run's message
with the ``semaphore_handoff`` header; the run claims its reservation when it starts. A
delivery that finds nothing to claim (a duplicate) ends quietly. Every worker sweeps the
rooms on its timer, so a room drains even when the process that should have published a
hand-off died.

Why not RETRY, as a shed stores: a shed publishes its message only after storing RETRY, but a
parked run's message is published by whoever releases a slot, possibly before the parking
run could store anything; its RETRY could then land on top of the SUCCESS of its own hand-off
run, and ``AsyncResult.get()`` would wait for ever.
"""

from __future__ import annotations

import atexit
import collections
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any, NoReturn

from celery import Celery, Task
from celery.exceptions import Ignore
from kombu.serialization import dumps, loads

from ..core.group import SlotGroup
from ..core.room import Publisher
from ..core.scripts import Handoff, NotWaiting, Parked, RoomFull
from ..core.semaphore import Semaphore
from ..core.slot import Slot
from ..errors import SemaphoreNotAcquiredError
from .handoff_queues import handoff_queue, handoff_queue_for
from .policy import Policy
from .settings import app_settings
from .shedding import (
    FIRST_SHED_HEADER,
    GIVE_UP_HEADER,
    HANDOFF_HEADER,
    HANDOFF_ID_HEADER,
    HANDOFF_QUEUE_HEADER,
    SHED_ATTEMPT_HEADER,
    retry_headers,
)
from .signals import Names, semaphore_parked, send_event, task_label
from .stats import bump

logger = logging.getLogger(__name__)

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
    """Whether this delivery was published by a sweep because the run's ``shed_timeout``
    passed while it was parked."""
    return bool((request.headers or {}).get(GIVE_UP_HEADER)) and is_handoff(request)


def payload_of(task: Task, request: Any, headers: dict[str, Any]) -> bytes:
    """The running task's message (``request``) as Celery's ``retry()`` would publish it,
    serialized with the task's serializer, plus ``headers``, and the name of the hand-off
    queue of the queue it came from, when its worker consumes one (see
    :mod:`~celery_semaphore.integration.handoff_queues`)."""
    own, lane = handoff_queue_for(task.app, request.delivery_info)
    if lane is not None:
        headers = {**headers, HANDOFF_QUEUE_HEADER: lane}
    signature = task.signature_from_request(request, headers=headers, queue=own)
    serializer = task.serializer or task.app.conf.task_serializer
    content_type, encoding, body = dumps(dict(signature), serializer=serializer)  # type: ignore[no-untyped-call]
    data = body.encode(encoding) if isinstance(body, str) else body
    return f"{content_type}\n{encoding}\n".encode() + data


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
            content_type, encoding, body = handoff.payload.split(b"\n", 2)
            options = loads(body, content_type.decode(), encoding.decode(), accept=None)  # type: ignore[no-untyped-call]
            signature = app.signature(options)
            headers = signature.options.setdefault("headers", {})
            headers[HANDOFF_ID_HEADER] = uuid.uuid4().hex
            if handoff.give_up:
                headers[GIVE_UP_HEADER] = True
            if priority is not None:
                signature.options["priority"] = priority
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
        does. Another copy of a hand-off (a stranded prefetch, a sweep's second publish)
        carries another id, and ends quietly.

    Raises:
        celery.exceptions.Ignore: the reservation lapsed and the run is parked again (its
            next hand-off starts it), or there was nothing to claim (a duplicate delivery,
            whose task already ran or runs elsewhere).
    """
    delivery = str((task.request.headers or {}).get(HANDOFF_ID_HEADER) or "")
    result: Slot | SlotGroup | Parked | NotWaiting
    if many:
        result = semaphore.claim_many(many, task.request.id, metadata=metadata, delivery=delivery)
    else:
        result = semaphore.claim(
            key, task.request.id, limit=limit, weight=weight, metadata=metadata, delivery=delivery
        )
    if isinstance(result, (Slot, SlotGroup)):
        return result
    if isinstance(result, NotWaiting):
        if result.again:
            return None
        logger.info("%sa duplicate hand-off of semaphore %r ends here", task_label(task), key)
    raise Ignore()


def give_up_or_end(
    task: Task, semaphore: Semaphore, policy: Policy, keys: Sequence[str], limit: int
) -> NoReturn:
    """End a run whose ``shed_timeout`` passed while it was parked: take it out of the room
    and fail it, unless a hand-off got to it first (then this delivery ends quietly).

    Raises:
        SemaphoreNotAcquiredError: the run was still parked; it is out of the room now.
        celery.exceptions.Ignore: it was no longer parked.
    """
    key = "+".join(keys)
    if not any([semaphore.admin.cancel(k, task.request.id) for k in keys]):
        raise Ignore()
    headers = task.request.headers or {}
    waited = time.time() - float(headers.get(FIRST_SHED_HEADER) or time.time())
    raise SemaphoreNotAcquiredError(
        f"semaphore {key!r} (limit {limit}): parked for {waited:.1f}s, past "
        f"shed_timeout={policy.shed_timeout}; task {task.request.id} gives up",
        key,
        limit,
    )


def park_or_take(
    task: Task,
    semaphore: Semaphore,
    policy: Policy,
    key: str,
    limit: int,
    weight: int,
    metadata: dict[str, Any],
    names: Names,
    asked: float | None = None,
    many: Sequence[tuple[str, int, int]] | None = None,
    group: str = "",
) -> Slot | SlotGroup:
    """Take a slot of ``key`` in arrival order, or park the running task in the key's room.

    ``asked`` is when this run first asked for a slot (epoch seconds; None: now), for a run
    that waited in the worker before parking. With ``many`` (``(key, limit, weight)`` of each
    of several keys), it takes every key or waits in the room of the first that cannot take
    it yet (see :meth:`Semaphore.park_many`). ``group`` is its fair-turn group (see
    :meth:`Semaphore.park`). ``names`` names the key or keys in the parked signal.

    Returns:
        Slot | SlotGroup: a slot (of each key), when no older run is parked and one was free.

    Raises:
        celery.exceptions.Ignore: the run is parked (its state is left as it was); a hand-off starts
            it again.
        SemaphoreNotAcquiredError: the room already holds ``max_queued`` runs.

    With ``shed_timeout`` set, the run gives up that many seconds after it first asked: a
    sweep publishes it marked to fail (see :func:`give_up_or_end`).
    """
    request = task.request
    attempt = request.retries or 0
    marks = request.headers or {}
    # A retry the task asked for itself carries the headers on: it is a new arrival.
    same_attempt = marks.get(SHED_ATTEMPT_HEADER) == attempt
    now = time.time() if asked is None else asked
    arrival = float(marks.get(FIRST_SHED_HEADER) or now) if same_attempt else now

    def payload() -> bytes:
        headers = retry_headers(request)
        headers.update(
            {HANDOFF_HEADER: attempt, FIRST_SHED_HEADER: arrival, SHED_ATTEMPT_HEADER: attempt}
        )
        return payload_of(task, request, headers)

    deadline = None if policy.shed_timeout is None else arrival + policy.shed_timeout
    options: dict[str, Any] = {"arrival": arrival, "metadata": metadata, "deadline": deadline,
                               "max_queued": policy.max_queued or 0}  # fmt: skip
    result: Slot | SlotGroup | Parked | RoomFull
    if many:
        result = semaphore.park_many(many, request.id, payload(), **options)
    else:
        # The message is serialized only if the run is to park: a run that finds a free slot
        # on a key with no room takes it without (unless it has waited in the worker for a
        # full key already, asked, and would only pay one more round trip for the try).
        result = semaphore.park(
            key, request.id, payload if asked is None else payload(), limit=limit,
            weight=weight, group=group, **options,
        )  # fmt: skip
    if isinstance(result, (Slot, SlotGroup)):
        return result
    if isinstance(result, RoomFull):
        raise SemaphoreNotAcquiredError(
            f"semaphore {key!r} (limit {limit}): all slots held and "
            f"{result.queued} runs already parked (max_queued={policy.max_queued})",
            key,
            limit,
        )
    _parked(task, names, result.limit or limit, result)


def _parked(task: Task, names: Names, limit: int, parked: Parked) -> NoReturn:
    key = names.key
    logger.info(
        "%ssemaphore %r (limit %d): parked, %d run(s) ahead",
        task_label(task),
        key,
        limit,
        parked.position,
    )
    semaphore_parked.send(sender=task, limit=limit, position=parked.position, **names.fields())
    send_event(task, "parked", key=key, limit=limit, position=parked.position)
    bump(task.app, task.request.hostname, "parked")
    raise Ignore()
