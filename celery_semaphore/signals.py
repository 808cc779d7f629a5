"""Celery signals, task events and worker counters for the moments a bounded task lives through.

Signals (``celery.utils.dispatch.Signal``, like Celery's own) are sent in the process that runs
the body, with the task as sender::

    from celery_semaphore.signals import semaphore_shed

    @semaphore_shed.connect
    def on_shed(sender, key, limit, countdown, sheds, reason, **kwargs): ...

================================ ==========================================================
signal                           keyword arguments
================================ ==========================================================
``semaphore_acquired``           key, limit, slot, waited (seconds spent acquiring)
``semaphore_released``           key, limit, slot, held (seconds), lost (bool)
``semaphore_shed``               key, limit, countdown (s), sheds (count so far), reason
``semaphore_lease_lost``         key, limit, slot, reason
``semaphore_renew_failed``       key, limit, slot, error
================================ ==========================================================

When the worker sends task events (``-E`` / ``worker_send_task_events``), the same moments are
also sent as ``task-semaphore-acquired``, ``task-semaphore-shed`` and
``task-semaphore-lost`` events, which Flower lists with the task and counts in its
Prometheus event counter.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.utils.dispatch import Signal

logger = logging.getLogger("celery_semaphore")

semaphore_acquired = Signal(
    name="semaphore_acquired", providing_args={"key", "limit", "slot", "waited"}
)
semaphore_released = Signal(
    name="semaphore_released", providing_args={"key", "limit", "slot", "held", "lost"}
)
semaphore_shed = Signal(
    name="semaphore_shed", providing_args={"key", "limit", "countdown", "sheds", "reason"}
)
semaphore_lease_lost = Signal(
    name="semaphore_lease_lost", providing_args={"key", "limit", "slot", "reason"}
)
semaphore_renew_failed = Signal(
    name="semaphore_renew_failed", providing_args={"key", "limit", "slot", "error"}
)


def send_event(task: Task | None, event: str, **fields: Any) -> None:
    """Send task event ``task-semaphore-<event>`` if the worker sends task events.

    Never raises: an event that cannot be published is logged, and the task goes on.
    """
    if task is None or task.request.is_eager or task.request.called_directly:
        return
    if not task.app.conf.worker_send_task_events:
        return
    try:
        task.send_event(f"task-semaphore-{event}", retry=False, **fields)
    except Exception:
        logger.warning("could not send task-semaphore-%s event", event, exc_info=True)
