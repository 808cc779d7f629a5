"""Parking, Celery side: a run that found its key full waits in the key's waiting room with
its message, instead of in a worker process.

With ``on_full="queue"`` (the default) a run that finds every slot held is parked in the
key's room (see :mod:`celery_semaphore.core.room`) with its message, as Celery's own
``retry()`` would publish it, and ends with its state left as it was (PENDING, or STARTED
with ``task_track_started``): it has not run yet. A release then reserves the slot for the
oldest parked run and publishes that run's message (:mod:`.handoffs`); the run claims the
reservation when it starts. The workers sweep the rooms between them (:mod:`.sweeps`), so
a room drains even when the process that should have published a hand-off died.

Why not RETRY, as a shed stores: a shed publishes its message only after storing RETRY, but a
parked run's message is published by whoever releases a slot, possibly before the parking
run could store anything; its RETRY could then land on top of the SUCCESS of its own hand-off
run, and ``AsyncResult.get()`` would wait for ever.

Endings of runs that leave the waiting room without running (revoked, or expired): a parked
run gave its message up, so while it waits no worker holds it, and when it is revoked or its
``expires`` passes Celery has nothing to discard and stores nothing. A run that a sweep or a
cancel takes out of the room is therefore stored as Celery stores a revoked or expired task
it discards (``REVOKED``, with the reason ``"revoked"`` or ``"expired"``: see
:func:`end_as_revoked`), so that ``AsyncResult.get()`` raises ``TaskRevokedError`` instead of
waiting for ever. Only a run that was really taken out (its cancel found it parked or
reserved) is stored so, and never over a result already stored: a run that is running, or
ran, elsewhere keeps its own state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

from celery import Celery, Task, states
from celery.app.task import Context
from celery.exceptions import Ignore
from celery.utils.time import maybe_iso8601
from kombu.serialization import dumps, loads

from ...core.group import SlotGroup
from ...core.replies import Parked, RoomFull
from ...core.scripts import REDIS_ERRORS
from ...core.semaphore import Semaphore
from ...core.slot import Slot
from ...errors import Refusal, SemaphoreNotAcquiredError
from ..asks import Ask
from ..policy import Policy
from ..settings import app_settings, forget, journal_for
from ..shedding import (
    FIRST_SHED_HEADER,
    HANDOFF_HEADER,
    HANDOFF_QUEUE_HEADER,
    SHED_ATTEMPT_HEADER,
    first_asked,
    retry_headers,
)
from ..signals import Names, semaphore_parked, send_event, task_label
from ..stats import bump
from .incarnation import incarnation
from .queues import handoff_queue_for

logger = logging.getLogger(__name__)

INCARNATION_HEADER = "semaphore_incarnation"
"""The header of a parked run's message that holds the store's incarnation when it parked."""


def payload_of(task: Task, request: Any, headers: dict[str, Any]) -> bytes:
    """The running task's message (``request``) as Celery's ``retry()`` would publish it,
    serialized with the task's serializer, plus ``headers``, and the name of the hand-off
    queue of the queue it came from, when its worker consumes one (see
    :mod:`~celery_semaphore.integration.waiting_room.queues`)."""
    own, lane = handoff_queue_for(task.app, request.delivery_info)
    if lane is not None:
        headers = {**headers, HANDOFF_QUEUE_HEADER: lane}
    signature = task.signature_from_request(request, headers=headers, queue=own)
    serializer = task.serializer or task.app.conf.task_serializer
    content_type, encoding, body = dumps(dict(signature), serializer=serializer)  # type: ignore[no-untyped-call]
    data = body.encode(encoding) if isinstance(body, str) else body
    return f"{content_type}\n{encoding}\n".encode() + data


def message_of(payload: bytes) -> dict[str, Any]:
    """The signature (a dict: ``task``, ``args``, ``kwargs``, ``options``) a parked run's
    payload holds (see :func:`.parking.payload_of`)."""
    content_type, encoding, body = payload.split(b"\n", 2)
    message: dict[str, Any] = loads(body, content_type.decode(), encoding.decode(), accept=None)  # type: ignore[no-untyped-call]
    return message


def has_ended(app: Celery, task_id: str, within: float = 0.0) -> bool:
    """Whether ``app``'s result backend holds a final state (SUCCESS, FAILURE, REVOKED) for
    ``task_id``: a run that ran, or was ended, somewhere; asked again for up to ``within``
    seconds (a run that just gave its slot back stores its result a moment later). False
    when there is no backend, when it fails, or for a task that stores no result: the
    caller must then assume it did not run. Never raises."""
    deadline = time.monotonic() + within
    try:
        while app.backend.get_state(task_id) not in states.READY_STATES:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
    except Exception:  # NotImplementedError with no backend, or any backend's error
        return False
    return True


def expires_at(expires: object) -> float | None:
    """A Celery ``expires`` (an ISO 8601 string, as a message carries it, or a datetime) as
    epoch seconds; None when there is none. A naive time is local, as Celery reads it."""
    if expires is None or expires == "":
        return None
    if isinstance(expires, (int, float)):
        return float(expires)
    when = maybe_iso8601(expires)
    return when.timestamp() if isinstance(when, datetime) else None


def end_as_revoked(app: Celery, task_id: str, reason: str = "revoked", request: Any = None) -> bool:
    """Store run ``task_id``, just taken out of the waiting room, as Celery stores a task it
    discards: state REVOKED with a ``TaskRevokedError(reason)``; with ``request`` (the run's
    Celery request, or the :class:`~celery.app.task.Context` of its message) a chord it
    belongs to is told too. Nothing is stored over a result already there (SUCCESS,
    FAILURE, REVOKED), or for a task that ignores results. Never raises: a backend that
    fails is logged.

    Args:
        app (Celery): the run's app.
        task_id (str): the run's id.
        reason (str): ``"revoked"`` or ``"expired"``.
        request (Any): the run's request or context, or None.

    Returns:
        bool: whether the run was ended so (False: a result was stored already, or the
        backend failed).
    """
    name = getattr(request, "task", None)
    task = app.tasks.get(str(getattr(name, "name", name) or ""))
    backend = task.backend if task is not None else app.backend
    # As Celery stores a task it discards: a task that ignores results stores only errors,
    # if told to, and its chord is told all the same.
    store = task is None or not task.ignore_result or task.store_errors_even_if_ignored
    try:
        if backend.get_state(task_id) in states.READY_STATES:
            return False
        backend.mark_as_revoked(task_id, reason, request=request, store_result=store)
    except NotImplementedError:  # no result backend configured
        return False
    except Exception:
        logger.warning("could not store task %s as %s", task_id, reason, exc_info=True)
        return False
    logger.info("task %s left the waiting room: %s", task_id, reason)
    return True


def context_of(message: Mapping[str, Any]) -> Context:
    """The Celery request context of a parked run's message (see :func:`message_of`), as
    the worker that received it would have built it: enough for a backend to store its
    state and to tell its chord."""
    options = message.get("options") or {}
    return Context(
        id=options.get("task_id"),
        task=message.get("task"),
        args=message.get("args"),
        kwargs=message.get("kwargs"),
        group=options.get("group_id"),
        group_index=options.get("group_index"),
        chord=options.get("chord"),
        root_id=options.get("root_id"),
        parent_id=options.get("parent_id"),
        callbacks=options.get("link"),
        errbacks=options.get("link_error"),
        reply_to=options.get("reply_to"),
        headers=options.get("headers"),
        delivery_info={"is_eager": False},
    )


def give_up_or_end(
    task: Task, semaphore: Semaphore, policy: Policy, keys: Sequence[str], limit: int
) -> NoReturn:
    """End a run whose deadline passed while it was parked: take it out of the room and fail
    it, unless a hand-off got to it first (then this delivery ends quietly). A run whose
    ``expires`` came before its ``queue_timeout`` ends as an expired task instead: REVOKED,
    as Celery stores one (a sweep ends most such runs itself; this is the one whose
    give-up a sweep published because, by its worker's clock, it had not expired yet).

    Raises:
        SemaphoreNotAcquiredError: the run was still parked; it is out of the room now.
        celery.exceptions.Ignore: it was no longer parked, or it expired.
    """
    key = "+".join(keys)
    if not any([semaphore.room.cancel(k, task.request.id) for k in keys]):
        raise Ignore()
    forget(task.app, task.request.id)
    request = task.request
    headers = request.headers or {}
    first = float(headers.get(FIRST_SHED_HEADER) or time.time())
    expires = expires_at(request.expires)
    seconds, option = policy.queue_budget()
    budget = None if seconds is None else first + seconds
    if expires is not None and (budget is None or expires <= budget):
        end_as_revoked(task.app, request.id, "expired", request)
        raise Ignore()
    waited = time.time() - first
    raise SemaphoreNotAcquiredError(
        f"semaphore {key!r} (limit {limit}): parked for {waited:.1f}s, past "
        f"{option}={seconds}; task {task.request.id} gives up",
        key,
        limit,
        Refusal.TIMEOUT,
    )


def park_or_take(
    task: Task,
    semaphore: Semaphore,
    policy: Policy,
    ask: Ask,
    metadata: dict[str, Any],
    names: Names,
    asked: float | None = None,
) -> Slot | SlotGroup:
    """Take a slot of the key ``ask`` names in arrival order, or park the running task in
    the key's room.

    ``asked`` is when this run first asked for a slot (epoch seconds; None: now), for a run
    that waited in the worker before parking. An ask of several keys takes every key or
    waits in the room of the first that cannot take it yet (see
    :meth:`WaitingRoom.park_many`); an ask of one parks with its tenant for fair turns and
    its head start (see :meth:`WaitingRoom.park`). ``names`` names the key or keys in the
    parked signal.

    Returns:
        Slot | SlotGroup: a slot (of each key), when no older run is parked and one was free.

    Raises:
        celery.exceptions.Ignore: the run is parked (its state is left as it was); a hand-off starts
            it again.
        SemaphoreNotAcquiredError: the room already holds ``max_queued`` runs.

    With ``queue_timeout`` (or the deprecated ``shed_timeout``) set, the run gives up that
    many seconds after it first asked: a sweep publishes it marked to fail (see
    :func:`give_up_or_end`). With ``expires`` set, the next sweep after it passes takes the
    run out and stores it REVOKED, as Celery stores an expired task (see :mod:`.sweeps`).
    """
    key, limit, weight, many = ask.key, ask.limit, ask.weight, ask.many
    request = task.request
    attempt = request.retries or 0
    # A retry the task asked for itself carries the headers on: it is a new arrival.
    arrival = first_asked(request) or (time.time() if asked is None else asked)
    made: list[bytes] = []

    def payload() -> bytes:
        """The message to park, stamped with the store's incarnation and journaled first
        (see :mod:`.journal` for why before, and :func:`.handoffs.claim_or_end` for the
        stamp)."""
        stamp = stamp_of(semaphore)
        headers = retry_headers(request)
        headers.update({HANDOFF_HEADER: attempt, FIRST_SHED_HEADER: arrival,
                        SHED_ATTEMPT_HEADER: attempt, INCARNATION_HEADER: stamp})  # fmt: skip
        made.append(payload_of(task, request, headers))
        journal = journal_for(task.app)
        if journal is not None:
            journal.record(request.id, ask.keys, made[-1], stamp)
        return made[-1]

    # The room judges the wait on the store's clock: it is told how long this run has asked
    # already (this worker's clock, measured against itself) and its budget, never a
    # timestamp that a worker whose clock is off would shift. An expiry counts as a budget
    # too (what is left of it by this worker's clock, as Celery judges expiry): a sweep then
    # takes the run out once it expired, rather than keep it parked (and counted against
    # max_queued) until a slot frees.
    waited = max(0.0, time.time() - arrival)
    expiry = expires_at(request.expires)
    budgets = [policy.queue_budget()[0],
               None if expiry is None else max(0.001, waited + expiry - time.time())]  # fmt: skip
    options: dict[str, Any] = {"waited": waited, "metadata": metadata,
                               "budget": min((b for b in budgets if b is not None), default=None),
                               "max_queued": policy.max_queued or 0,
                               "room_ttl": app_settings(task.app).room_ttl}  # fmt: skip
    result: Slot | SlotGroup | Parked | RoomFull
    if many:
        result = semaphore.room.park_many(many, request.id, payload(), **options)
    else:
        # The message is serialized only if the run is to park: a run that finds a free slot
        # on a key with no room takes it without (unless it has waited in the worker for a
        # full key already, asked, and would only pay one more round trip for the try).
        result = semaphore.room.park(
            key, request.id, payload if asked is None else payload(), limit=limit,
            weight=weight, tenant=ask.tenant, head_start=ask.head_start, rates=policy.rates,
            units=ask.units, **options,
        )  # fmt: skip
    if not isinstance(result, Parked) and (made or HANDOFF_HEADER in (request.headers or {})):
        forget(task.app, task.request.id)  # journaled to park, or parked before: not waiting
    if isinstance(result, (Slot, SlotGroup)):
        return result
    if isinstance(result, RoomFull):
        raise SemaphoreNotAcquiredError(
            f"semaphore {key!r} (limit {limit}): all slots held and "
            f"{result.queued} runs already parked (max_queued={policy.max_queued})",
            key,
            limit,
            Refusal.ROOM_FULL,
        )
    _parked(task, names, result.limit or limit, result)


def stamp_of(semaphore: Semaphore) -> str:
    """The store's incarnation, as a parked run is stamped with it ("" if it cannot be read:
    the run is then looked up as if the store had changed)."""
    try:
        return incarnation(semaphore.client, semaphore.prefix)
    except REDIS_ERRORS:
        return ""


def _parked(task: Task, names: Names, limit: int, parked: Parked) -> NoReturn:
    logger.info(
        "%ssemaphore %r (limit %d): parked, %d run(s) ahead",
        task_label(task),
        names.key,
        limit,
        parked.position,
    )
    semaphore_parked.send(sender=task, limit=limit, position=parked.position, **names.fields())
    send_event(task, "parked", key=names.key, limit=limit, position=parked.position)
    bump(task.app, task.request.hostname, "parked")
    raise Ignore()
