"""Endings of runs that leave the waiting room without running: revoked, or expired.

A parked run gave its message up (see :mod:`.parking`): while it waits, no worker holds it,
so when it is revoked or its ``expires`` passes, Celery has nothing to discard and stores
nothing. A run that a sweep or a cancel takes out of the room is therefore stored here as
Celery stores a revoked or expired task it discards (``REVOKED``, with the reason
``"revoked"`` or ``"expired"``), so that ``AsyncResult.get()`` raises
``TaskRevokedError`` instead of waiting for ever.

Only a run that was really taken out (its cancel found it parked or reserved) is stored so,
and never over a result already stored: a run that is running, or ran, elsewhere keeps its
own state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery import Celery, states
from celery.app.task import Context
from celery.utils.time import maybe_iso8601
from kombu.serialization import loads

logger = logging.getLogger(__name__)


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
    while True:
        try:
            if app.backend.get_state(task_id) in states.READY_STATES:
                return True
        except Exception:  # NotImplementedError with no backend, or any backend's error
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


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
