"""Shedding: end a run that found every slot held, and publish it again with a countdown.

The message is the one Celery's own ``retry()`` would publish (same id, same ``retries``),
less the headers a broker added, plus the semaphore's headers that count the sheds of this
attempt. See :func:`shed` for why RETRY is stored before publishing.

The semaphore's message headers are all here: the shed headers, which a parked run also
carries to keep its first arrival, and the waiting room's, which a hand-off's message
carries so that the run it starts knows it was handed a slot, by which publish, and where
hand-offs of it go.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore

from ..errors import Refusal, SemaphoreNotAcquiredError
from .policy import Policy, countdown
from .settings import forget
from .signals import Names, semaphore_shed, send_event, task_label
from .stats import bump

logger = logging.getLogger(__name__)

SHEDS_HEADER = "semaphore_sheds"
"""Message header: how many times this task was shed so far."""
FIRST_SHED_HEADER = "semaphore_first_shed_at"
"""Message header: epoch seconds of the first shed, for the ``shed_timeout`` budget."""
COOL_DOWN_HEADER = "semaphore_cool_down_ends"
"""Message header: when the cool-down this run was shed for ends (epoch seconds), if its
countdown was cut to ``shed_max_countdown`` (see :func:`shed`)."""
BACK_OFFS_HEADER = "semaphore_back_offs"
"""Message header: how many times this run backed off so far (see ``max_back_offs``)."""
SHED_ATTEMPT_HEADER = "semaphore_shed_attempt"
"""Message header: the ``request.retries`` the two above count for. Each attempt (each retry
the task asks for itself) gets a fresh shed budget, so a user's ``self.retry()`` or
``autoretry_for`` is never refused for sheds an earlier attempt spent."""

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
"""The marks of one delivery, which a message published again (shed or parked) leaves out;
but a hand-off shed because the store was out of reach keeps them (see :func:`shed`)."""

BROKER_HEADERS = frozenset(
    {
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
        "x-delivery-count",
        "redelivered",
    }
)
"""Headers a broker adds to a delivered message (RabbitMQ's; kombu's Redis transport marks a
restored message ``redelivered``). Published again, RabbitMQ (before 4.0.1,
with quorum queues and delayed delivery) takes the message for a dead-letter cycle and drops
it; Celery's own ``retry()`` leaves the ``x-death`` family out (5.7 and later) for that
reason, and a shed leaves out all of them whatever the Celery version."""


def retry_headers(request: Any) -> dict[str, Any]:
    """The headers Celery's own ``retry()`` would publish for ``request``, less anything the
    broker added (:data:`BROKER_HEADERS`) and the hand-off marks of this delivery."""
    headers = request.as_execution_options().get("headers") or {}
    return {
        k: v for k, v in headers.items() if k not in BROKER_HEADERS and k not in HANDOFF_HEADERS
    }


def first_asked(request: Any) -> float | None:
    """When this attempt of the run first asked for a slot (epoch seconds, worker clock), if
    it was shed or parked before; None for a first ask."""
    headers = request.headers or {}
    if headers.get(SHED_ATTEMPT_HEADER) != (request.retries or 0):
        return None
    value = headers.get(FIRST_SHED_HEADER)
    return float(value) if value else None


def shed(
    task: Task, policy: Policy, names: Names, limit: int | None, reason: str,
    refusal: Refusal | None = None, at_least: float = 0.0,
) -> NoReturn:  # fmt: skip
    """Publish the running task again with a countdown and end this run in state RETRY.

    The RETRY state is stored *before* the message is published, and the run then ends with
    ``Ignore`` so that Celery stores nothing more for it. Ending with ``Retry`` instead
    would have Celery store RETRY after publishing, and a re-run quick enough to finish
    first would have its SUCCESS overwritten (the result backend's check for SUCCESS and its
    write are two steps): ``result.get()`` would then wait forever on a task that succeeded.
    Celery's ``task_retry`` signal and ``on_retry`` hook therefore do not fire for a shed;
    :data:`~celery_semaphore.signals.semaphore_shed` does.

    No countdown is longer than ``shed_max_countdown``, a back-off's cool-down included: a
    message held back longer than a broker allows is delivered twice (a Redis broker's
    ``visibility_timeout``; the worker refuses a ``shed_max_countdown`` over half of it).
    A longer cool-down is waited out in pieces: the run comes back still cooling, finds no
    slot, and is shed again for the rest of it (:data:`COOL_DOWN_HEADER`), which neither
    counts as a shed nor spends the shed budget.

    A hand-off shed because the store was out of reach (``refusal`` ``BACKEND``) keeps its
    hand-off marks and stays in the host's journal: back, it claims its slot as a hand-off
    does, and a second copy of it (a sweep published it again while the first copy's run
    was claiming) ends there rather than asking for a slot as a new run and running twice.

    Args:
        task (Task): the running task.
        policy (Policy): its options (the shed countdowns and budget).
        names (Names): its key or keys, for the messages and the signal.
        limit (int | None): its (first key's) limit; None when it could not be computed.
        reason (str): why it is shed, for the log line and the signal.
        refusal (Refusal | None): the error's reason if the budget is spent; None: ``FULL``
            for a spent count (``shed_max_retries``), ``TIMEOUT`` for spent time.
        at_least (float): the shortest countdown, seconds (a back-off's cool-down).

    Raises:
        celery.exceptions.Ignore: always, after storing RETRY and publishing.
        SemaphoreNotAcquiredError: the shed budget (count or time) is spent; nothing is
            published and the task fails.
    """
    key = names.key
    request = task.request
    headers = retry_headers(request)
    # The rest of a cool-down that an earlier shed's countdown was cut short of.
    cooling = float(headers.pop(COOL_DOWN_HEADER, 0) or 0) - time.time()
    at_least = max(at_least, cooling)
    attempt = request.retries or 0
    # A hand-off that found the store out of reach keeps its marks (and its journal entry):
    # back, it claims, so that a second copy of a run that claimed already (a sweep's
    # publish after its reservation lapsed) ends there instead of running as a new run.
    if refusal is Refusal.BACKEND and (request.headers or {}).get(HANDOFF_HEADER) == attempt:
        headers.update({k: v for k, v in request.headers.items() if k in HANDOFF_HEADERS})
    same_attempt = headers.get(SHED_ATTEMPT_HEADER) == attempt
    sheds = int(headers.get(SHEDS_HEADER) or 0) if same_attempt else 0
    first = float(headers.get(FIRST_SHED_HEADER) or time.time()) if same_attempt else time.time()
    spent = ""
    if policy.shed_max_retries is not None and sheds >= policy.shed_max_retries:
        spent = f"shed {sheds} times (shed_max_retries={policy.shed_max_retries})"
        refusal = refusal or Refusal.FULL
    elif policy.shed_timeout is not None and time.time() - first >= policy.shed_timeout:
        spent = f"shed for {time.time() - first:.1f}s (shed_timeout={policy.shed_timeout:g})"
        refusal = refusal or Refusal.TIMEOUT
    if spent and cooling <= 0:
        raise SemaphoreNotAcquiredError(
            f"semaphore {key!r} (limit {limit}): {reason}; task {request.id} {spent}",
            key,
            limit,
            refusal or Refusal.FULL,
        )
    delay = max(at_least, countdown(policy, sheds, random.random()))
    if delay > policy.shed_max_countdown:  # a cool-down: waited out in pieces (see above)
        headers[COOL_DOWN_HEADER] = time.time() + delay
        delay = policy.shed_max_countdown
    # Celery's native delayed delivery (RabbitMQ quorum queues, Celery 5.5+) delays by whole
    # seconds and fails the run for a countdown under one: such a shed asks again at once.
    if delay < 1 and any(q.queue_arguments and q.queue_arguments.get("x-queue-type") == "quorum"
                         for q in task.app.amqp.queues.values()):  # fmt: skip
        delay = 0.0
    sheds += cooling <= 0  # a piece of a cool-down is not a shed of its own
    headers.update({SHEDS_HEADER: sheds, FIRST_SHED_HEADER: first, SHED_ATTEMPT_HEADER: attempt})
    # RETRY, stored before the message is published again (see above for why before),
    # unless the task ignores results or there is no backend.
    if not (task.ignore_result or getattr(request, "ignore_result", False)):
        with contextlib.suppress(NotImplementedError):  # no result backend configured
            task.backend.mark_as_retry(request.id, None, request=request)
    task.signature_from_request(request, countdown=delay, headers=headers).apply_async()
    if HANDOFF_HEADER in (request.headers or {}) and HANDOFF_HEADER not in headers:
        # A run that parked before lives in the broker again: the journal must not send it
        # again as lost from a store it could not reach (see waiting_room.journal).
        forget(task.app, request.id)
    logger.info(
        "%ssemaphore %r (limit %s): shed (%s), runs again in %.2fs",
        task_label(task),
        key,
        limit,
        reason,
        delay,
    )
    semaphore_shed.send(
        sender=task, limit=limit, countdown=delay, sheds=sheds, reason=reason, **names.fields()
    )
    send_event(task, "shed", key=key, limit=limit, countdown=delay, sheds=sheds, reason=reason)
    bump(task.app, request.hostname, "shed")
    raise Ignore()
