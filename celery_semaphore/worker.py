"""Worker-side hooks: free the slot of a task whose process died under it.

Freed as soon as the worker's main process sees the pool process gone (Celery notices a
SIGKILLed child within about a second, occasionally a few) and the holder's process has
exited; see :func:`release_dead_run`.

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
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Task
from celery.signals import task_failure, task_revoked
from celery.utils.log import get_logger

from .bounded import Bounded
from .errors import SemaphoreError, SemaphoreValidationError
from .semaphore import Holder, Semaphore
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


def refusal_of(task: Any) -> SemaphoreValidationError | None:
    """The error every run of ``task`` raises because its semaphore options are invalid."""
    run = inspect.getattr_static(type(task), "run", None)
    fn = run.__func__ if isinstance(run, staticmethod) else run
    error = getattr(fn, "__semaphore_error__", None)
    return error if isinstance(error, SemaphoreValidationError) else None


def release_dead_run(
    task: Task, task_id: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> int:
    """Release the slots that run ``task_id`` of ``task`` holds from this host, once the
    process that holds each one is gone.

    A holder whose process is already dead is released now. One whose process still runs
    (a hard time limit is signalled to the child just *after* Celery reports it; a revoke
    may send a signal the child ignores) is checked again on the worker's timer every
    ``RECHECK`` seconds for up to ``PATIENCE`` seconds, and left to its lease if it lives on:
    a body that keeps running keeps renewing, and must keep its slot.

    Returns:
        int: how many slots were released now (later releases are logged, not counted).
    """
    found = bounded_of(task)
    if found is None or not task_id:
        return 0
    bounded, takes_task = found
    try:
        key = bounded.key_for((task, *args) if takes_task else tuple(args), kwargs)
        semaphore, _ = bounded.resolve(task.app)
        holders = [
            h
            for h in semaphore.holders(key)
            if h.metadata.get("task_id") == task_id and h.metadata.get("host") == _HOST
        ]
    except (SemaphoreError, TypeError) as exc:
        logger.warning("could not find the slot of dead task %s: %s", task_id, exc)
        return 0
    released = 0
    for holder in holders:
        release = _Release(task.app, semaphore, key, holder, task_id)
        if release.attempt():
            released += 1
        elif _timer is not None:
            _timer.call_after(RECHECK, release.retry)
    return released


RECHECK = 0.1
PATIENCE = 10.0
_timer: Any = None  # the worker's kombu timer, set by its bootstep (see control.py)


def use_timer(timer: Any) -> None:
    """Let later releases run on ``timer`` (the worker's ``kombu`` timer)."""
    global _timer
    _timer = timer


class _Release:
    """Releases one dead run's slot once its process is gone."""

    def __init__(
        self, app: Any, semaphore: Semaphore, key: str, holder: Holder, task_id: str
    ) -> None:
        self.app, self.semaphore, self.key, self.holder, self.task_id = (
            app,
            semaphore,
            key,
            holder,
            task_id,
        )
        self.deadline = time.monotonic() + PATIENCE

    def attempt(self) -> bool:
        """Release if the holder's process is gone; True when released (or already free)."""
        pid = self.holder.metadata.get("pid")
        if isinstance(pid, int) and not _pid_gone(pid):
            return False
        try:
            if self.semaphore.force_release(self.key, self.holder.token):
                bump(self.app, self.holder.metadata.get("worker"), "dead_released")
                logger.warning(
                    "semaphore %r: released the slot of task %s, whose process died",
                    self.key,
                    self.task_id,
                )
        except SemaphoreError as exc:
            logger.warning("could not release the slot of dead task %s: %s", self.task_id, exc)
        return True

    def retry(self) -> None:
        if not self.attempt() and time.monotonic() < self.deadline and _timer is not None:
            _timer.call_after(RECHECK, self.retry)


def _pid_gone(pid: int) -> bool:
    """True when process ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


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
