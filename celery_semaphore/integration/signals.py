"""Celery signals, task events and worker counters for the moments a bounded task lives through.

Signals (``celery.utils.dispatch.Signal``, like Celery's own) are sent in the process that runs
the body, with the task as sender::

    from celery_semaphore.signals import semaphore_shed

    @semaphore_shed.connect
    def on_shed(sender, key, limit, countdown, sheds, reason, **kwargs): ...

Every signal also gets ``template``: the task's ``semaphore`` option as written (for a key
template such as ``"tenant:{tenant_id}"``, the template rather than the rendered key); and
``keys`` and ``templates``, lists naming every key the run holds and each one's own
template, in order. For a run of one key they are ``[key]`` and ``[template]``; for a run
of several, ``key`` and ``template`` join them with ``+`` (as they always have), and the
lists give each one apart (see :class:`Names`).

================================ ==========================================================
signal                           keyword arguments (besides keys, templates)
================================ ==========================================================
``semaphore_acquired``           key, limit, template, slot, waited (seconds acquiring)
``semaphore_released``           key, limit, template, slot, held (seconds), lost (bool)
``semaphore_shed``               key, limit, template, countdown (s), sheds (so far), reason
``semaphore_parked``             key, limit, template, position (older runs parked ahead)
``semaphore_refused``            key, limit, template, reason (a :class:`Refusal`), message
``semaphore_lease_lost``         key, limit, template, slot, reason
``semaphore_renew_failed``       key, limit, template, slot, error
``semaphore_backed_off``         key, limit, template, slot, retry_after (s or None),
                                 back_offs (of this run so far), cooling_until (epoch s)
================================ ==========================================================

When the worker sends task events (``celery worker -E``, or ``worker_send_task_events``; a
worker's ``-E`` is passed on to its pool processes when it starts), the same moments are
also sent as ``task-semaphore-acquired``, ``task-semaphore-shed``,
``task-semaphore-parked``, ``task-semaphore-backed-off`` and ``task-semaphore-lost`` events,
which Flower lists with the task and counts in its Prometheus event counter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from celery import Task
from celery.utils.dispatch import Signal

from ..core.group import SlotGroup
from ..core.slot import Slot
from ..core.tracing import refusal_event
from ..errors import SemaphoreNotAcquiredError
from . import stats

logger = logging.getLogger(__name__)

_COMMON = {"key", "limit", "template", "keys", "templates"}
semaphore_acquired = Signal(name="semaphore_acquired", providing_args=_COMMON | {"slot", "waited"})
semaphore_released = Signal(
    name="semaphore_released", providing_args=_COMMON | {"slot", "held", "lost"}
)
semaphore_shed = Signal(
    name="semaphore_shed", providing_args=_COMMON | {"countdown", "sheds", "reason"}
)
semaphore_parked = Signal(name="semaphore_parked", providing_args=_COMMON | {"position"})
semaphore_refused = Signal(name="semaphore_refused", providing_args=_COMMON | {"reason", "message"})
semaphore_lease_lost = Signal(
    name="semaphore_lease_lost", providing_args=_COMMON | {"slot", "reason"}
)
semaphore_renew_failed = Signal(
    name="semaphore_renew_failed", providing_args=_COMMON | {"slot", "error"}
)
semaphore_backed_off = Signal(
    name="semaphore_backed_off",
    providing_args=_COMMON | {"slot", "retry_after", "back_offs", "cooling_until"},
)


class Names(NamedTuple):
    """How the signals of one run name what it holds.

    Attributes:
        key (str): the rendered key; for a run of several keys, the keys joined with ``+``.
        template (str): the ``semaphore`` option as written; for several keys, each one's
            template joined with ``+``.
        keys (tuple[str, ...]): every rendered key the run holds, in order.
        templates (tuple[str, ...]): each key's own template, in the same order.
    """

    key: str
    template: str
    keys: tuple[str, ...]
    templates: tuple[str, ...]

    @classmethod
    def of(cls, keys: Sequence[str], templates: Sequence[str]) -> Names:
        """The names of a run holding ``keys``, whose templates are ``templates``."""
        return cls("+".join(keys), "+".join(templates), tuple(keys), tuple(templates))

    def fields(self) -> dict[str, Any]:
        """The keyword arguments every signal gets: ``key``, ``template``, ``keys`` and
        ``templates`` (the last two as lists)."""
        return {"key": self.key, "template": self.template, "keys": list(self.keys),
                "templates": list(self.templates)}  # fmt: skip


def send_event(task: Task | None, event: str, **fields: Any) -> None:
    """Send task event ``task-semaphore-<event>`` if the worker sends task events.

    Never raises: an event that cannot be published is logged, and the task goes on.
    """
    if task is None or task.request.is_eager or task.request.called_directly:
        return
    app = task.app
    # A worker records whether it sends task events (its -E or the setting) before it forks;
    # reading the setting costs more than the rest of this check, so only outside a worker.
    enabled = app.__dict__.get("_semaphore_task_events")
    if not (app.conf.worker_send_task_events if enabled is None else enabled):
        return
    try:
        task.send_event(f"task-semaphore-{event}", retry=False, **fields)
    except Exception:
        logger.warning("could not send task-semaphore-%s event", event, exc_info=True)


def task_label(task: Task | None) -> str:
    """``"Task <name>[<id>]: "`` to open a log line about a task's run (Celery's own wording),
    or ``""`` outside a task."""
    return "" if task is None else f"Task {task.name}[{task.request.id}]: "


def renew_failed_reporter(
    task: Task | None, slot: Slot | SlotGroup, names: Names
) -> Callable[[BaseException], None]:
    """The ``on_renew_error`` callback of a run's slot: log and signal each failed renewal
    round trip, once, even when it carried every slot of a group."""
    last: list[BaseException] = []

    def report(error: BaseException) -> None:
        # The renewer reports a failed round trip to each slot it carried, and a group's
        # slots travel in one round trip: the same error again is that round trip again.
        if last and last[0] is error:
            return
        last[:] = [error]
        logger.warning(
            "%ssemaphore %r: a renewal failed and will be retried: %s",
            task_label(task),
            slot.key,
            error,
        )
        semaphore_renew_failed.send(
            sender=task, limit=slot.limit, slot=slot, error=error, **names.fields()
        )

    return report


def report_lease_lost(task: Task | None, slot: Slot | SlotGroup, names: Names) -> None:
    """Log, signal, send an event and count the loss of a run's slot."""
    reason = slot.lease_lost_error().message
    logger.error("%s%s", task_label(task), reason)
    semaphore_lease_lost.send(
        sender=task, limit=slot.limit, slot=slot, reason=reason, **names.fields()
    )
    send_event(task, "lost", key=slot.key, limit=slot.limit, reason=reason)
    if task is not None:
        stats.bump(task.app, task.request.hostname, "lease_lost")


def report_refusal(
    task: Task | None, error: SemaphoreNotAcquiredError, names: Names
) -> SemaphoreNotAcquiredError:
    """Log, signal and trace that a run fails for want of a slot, with ``error.reason``: one
    INFO line (Celery logs the failure itself), ``semaphore_refused``, and a
    ``semaphore.refused`` event on the current span, if one records. Returns ``error``, for
    the caller to raise."""
    logger.info(
        "%ssemaphore %r (limit %s): refused (%s): %s",
        task_label(task),
        names.key,
        error.limit,
        error.reason,
        error.message,
    )
    semaphore_refused.send(
        sender=task, limit=error.limit, reason=error.reason, message=error.message,
        **names.fields(),
    )  # fmt: skip
    refusal_event(names.key, error.limit, error.reason.value)
    return error


def report_back_off(
    task: Task | None, slot: Slot | SlotGroup, names: Names, retry_after: float | None,
    back_offs: int,
) -> float:  # fmt: skip
    """Log (WARNING), signal and send as a task event that a run backed off, its
    ``back_offs``-th time; returns when its key's cool-down ends (epoch seconds)."""
    members = slot.slots if isinstance(slot, SlotGroup) else (slot,)
    cooling_until = max(member.cooling_until for member in members)
    logger.warning(
        "%ssemaphore %r (limit %s): backed off (%s), cooling down for %.1fs; back-off %d of "
        "this run", task_label(task), names.key, slot.limit,
        "no hint" if retry_after is None else f"retry after {retry_after:g}s",
        max(0.0, cooling_until - time.time()), back_offs,
    )  # fmt: skip
    semaphore_backed_off.send(
        sender=task, limit=slot.limit, slot=slot, retry_after=retry_after,
        back_offs=back_offs, cooling_until=cooling_until, **names.fields(),
    )  # fmt: skip
    send_event(task, "backed-off", key=names.key, limit=slot.limit, retry_after=retry_after,
               back_offs=back_offs, cooling_until=cooling_until)  # fmt: skip
    return cooling_until
