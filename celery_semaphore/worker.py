"""Worker-side hooks: free the slot of a task whose process died under it.

A prefork child killed by SIGKILL, the OOM killer or a hard time limit cannot release its
slot; without help the slot stays held until its lease runs out. The worker's main process
learns of such deaths (Celery sends ``task_failure`` with ``WorkerLostError`` or
``TimeLimitExceeded`` there, and ``task_revoked`` after ``revoke(terminate=True)``), so these
handlers find the dead run's holder in Redis (by task id and host) and release it at once.

When the message is requeued instead (``acks_late`` with ``reject_on_worker_lost``) Celery
sends no signal, and the slot lapses within one lease.
"""

from __future__ import annotations

import inspect
import socket
from collections.abc import Mapping
from typing import Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Task
from celery.signals import task_failure, task_revoked
from celery.utils.log import get_logger

from .bounded import Bounded
from .errors import SemaphoreError
from .stats import bump

logger = get_logger("celery_semaphore")

_HOST = socket.gethostname()


def bounded_of(task: Any) -> tuple[Bounded, bool] | None:
    """The :class:`Bounded` guarding ``task``'s run, and whether run takes the task first."""
    run = inspect.getattr_static(type(task), "run", None)
    is_static = isinstance(run, staticmethod)
    fn = run.__func__ if is_static else run
    found = getattr(fn, "__semaphore__", None)
    return (found, not is_static) if isinstance(found, Bounded) else None


def release_dead_run(
    task: Task, task_id: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> int:
    """Release every slot that run ``task_id`` of ``task`` holds from this host.

    Returns:
        int: how many live slots were released (0 when the run had released its own).
    """
    found = bounded_of(task)
    if found is None or not task_id:
        return 0
    bounded, takes_task = found
    try:
        key = bounded.key_for((task, *args) if takes_task else tuple(args), kwargs)
        semaphore, _ = bounded.resolve(task.app)
        released = 0
        for holder in semaphore.holders(key):
            meta = holder.metadata
            mine = meta.get("task_id") == task_id and meta.get("host") == _HOST
            if mine and semaphore.force_release(key, holder.token):
                released += 1
                bump(task.app, meta.get("worker"), "dead_released")
    except (SemaphoreError, TypeError) as exc:
        logger.warning("could not release the slot of dead task %s: %s", task_id, exc)
        return 0
    if released:
        logger.warning(
            "semaphore %r: released the slot of task %s, whose process died", key, task_id
        )
    return released


def _on_task_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    # Ordinary failures are sent from the process that ran the body, which released its
    # slot already; only these two mean that process is gone.
    if isinstance(exception, (WorkerLostError, TimeLimitExceeded)) and task_id:
        release_dead_run(sender, task_id, tuple(args or ()), dict(kwargs or {}))


def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if terminated and request is not None:
        release_dead_run(sender, request.id, tuple(request.args or ()), dict(request.kwargs or {}))


task_failure.connect(_on_task_failure, weak=False)
task_revoked.connect(_on_task_revoked, weak=False)
