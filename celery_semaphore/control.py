"""What a worker tells about its slots: ``celery inspect semaphores`` and ``inspect stats``.

Both read Redis (see :mod:`celery_semaphore.inspection`), filtered to the holders that
recorded this worker's node name, so they show slots held by any of its pool processes.
Both run in the worker's main process, between messages: they cost one SCAN pass and one
round trip per semaphore.

The inspect command is registered when this module is imported (``import celery_semaphore``
does it), which must happen in the ``celery`` CLI process too, since the CLI checks command
names: importing the app module that uses :class:`SemaphoreTask` or ``@bounded`` is enough.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, bootsteps
from celery.signals import worker_init
from celery.worker.control import inspect_command

from . import stats
from .config import app_settings, client_for
from .errors import SemaphoreBackendError, SemaphoreValidationError
from .inspection import held_by_worker, server_warnings
from .semaphore import logger
from .store import broker_visibility_timeout
from .worker import bounded_of, refusal_of, use_timer


def worker_report(app: Celery, worker: str) -> dict[str, Any]:
    """The slots ``worker``'s tasks hold now, and its counters.

    Returns:
        dict[str, Any]: ``{"held": [...], "counters": {...}}``, or ``{"error": "..."}`` when
        the semaphore store cannot be read (never raises: it answers remote control).
    """
    try:
        prefix = app_settings(app).prefix
        return {
            "held": held_by_worker(client_for(app), worker, prefix),
            "counters": stats.read(app, worker),
        }
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def semaphores(state: Any, **_: Any) -> dict[str, Any]:
    """Remote control: this worker's held slots (key, task id and name, pid, times)."""
    consumer = state.consumer
    return worker_report(consumer.app, consumer.hostname)


inspect_command(name="semaphores", help="List the semaphore slots this worker's tasks hold.")(
    semaphores
)


class SemaphoreStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: checks the bounded tasks, resets the counters, feeds ``inspect stats``.

    Creating the step resolves every bounded task's options against the app's
    ``semaphore_*`` settings, so a bad setting, or a task option that conflicts with one,
    stops the worker at start-up with a :class:`SemaphoreValidationError` naming it instead
    of failing the task's first run. With a Redis broker, a ``shed_max_countdown`` above
    half the broker's ``visibility_timeout`` is refused the same way: a message held back
    longer than that is delivered again, and the task runs twice.
    """

    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        app = worker.app
        visibility = broker_visibility_timeout(app)
        unreachable: SemaphoreBackendError | None = None
        for task in list(app.tasks.values()):
            refused = refusal_of(task)
            if refused is not None:
                raise refused
            found = bounded_of(task)
            if found is None:
                continue
            policy = app_settings(app).policy.with_options(found[0].options)
            if visibility is not None and policy.shed_max_countdown > visibility / 2:
                raise SemaphoreValidationError(
                    f"task {task.name!r}: shed_max_countdown ({policy.shed_max_countdown:g}s) "
                    f"must be at most half the Redis broker's visibility_timeout "
                    f"({visibility:g}s), or held-back messages are delivered twice",
                    None,
                    found[0].limit,
                )
            try:
                found[0].resolve(app)
            except SemaphoreBackendError as exc:
                unreachable = exc
        if unreachable is not None:
            # An unreachable store is no reason not to start: runs are shed until it is back.
            logger.warning("semaphore store unreachable at start-up: %s", unreachable)

    def start(self, worker: Any) -> None:
        use_timer(worker.timer)
        try:
            stats.reset(worker.app, worker.hostname)
            for warning in server_warnings(client_for(worker.app)):
                logger.warning("%s", warning)
        except Exception:  # telemetry and advice: never stop a worker over them
            logger.warning("could not check the semaphore store", exc_info=True)

    def info(self, worker: Any) -> dict[str, Any]:
        return {"semaphore": worker_report(worker.app, worker.hostname)}


def _add_step(sender: Any = None, **_: Any) -> None:
    # worker_init is sent before the worker builds its blueprint from app.steps, and before
    # it forks: what is set on the app here reaches every pool process.
    sender.app.__dict__["_semaphore_task_events"] = bool(getattr(sender, "task_events", False))
    steps = sender.app.steps["worker"]
    if SemaphoreStep not in steps:
        steps.add(SemaphoreStep)


worker_init.connect(_add_step, weak=False)
