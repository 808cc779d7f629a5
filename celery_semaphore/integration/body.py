"""Run a bounded task's body holding its slot: renewal, ``interrupt``, :func:`current_slot`,
and the signals and task events of the slot's life.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from celery import Task

from ..core import validation as check
from ..core.feedback import BackOff
from ..core.group import SlotGroup
from ..core.interrupt import Interrupter
from ..core.semaphore import guard
from ..core.slot import Slot
from ..errors import SemaphoreLeaseLostError
from .current import CURRENT
from .policy import Policy
from .signals import (
    Names,
    renew_failed_reporter,
    report_lease_lost,
    semaphore_acquired,
    semaphore_released,
    send_event,
)


def run_body(
    task: Task | None,
    slot: Slot | SlotGroup,
    policy: Policy,
    waited: float,
    names: Names,
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` holding ``slot``, renewed as ``policy`` says, and release
    it on every path out; report the moments of its life (see :mod:`.signals`).

    Args:
        task (Task | None): the running task (None for a plain call).
        slot (Slot | SlotGroup): the slot just taken (or the slots of several keys).
        policy (Policy): the heartbeat and ``interrupt`` to run under.
        waited (float): seconds the run waited for its slot, for the signals.
        names (Names): how the signals name the key or keys, and their templates.

    Returns:
        Any: what the body returned.

    Raises:
        SemaphoreLeaseLostError: the slot was lost while the body ran, even if it returned.
        BackOff: the body backed off (raised it, or one of ``policy.back_off_on``): the slot
            is given back with the back-off.
        Exception: whatever the body raised.
    """
    interval = check.heartbeat_interval(policy.heartbeat, slot.lease)
    interrupter: contextlib.AbstractContextManager[object] = (
        Interrupter(slot) if policy.interrupt else contextlib.nullcontext()
    )
    # A signal with no receivers is not sent: its arguments would be built for nobody.
    if semaphore_acquired.receivers:
        semaphore_acquired.send(
            sender=task, limit=slot.limit, slot=slot, waited=waited, **names.fields()
        )
    send_event(task, "acquired", key=slot.key, limit=slot.limit, waited=waited)
    started = time.monotonic()
    try:
        # In a worker the release is sent after the run (the process goes on to its next
        # task); a plain, eager or direct call gives the slot back before it returns.
        later = task is not None and not (task.request.is_eager or task.request.called_directly)
        with guard(slot, interval, renew_failed_reporter(task, slot, names), later):
            token = CURRENT.set(slot)
            try:
                with interrupter:
                    try:
                        return fn(*args, **kwargs)
                    except policy.back_off_types as exc:  # the guard backs off on BackOff
                        raise BackOff.from_error(exc) from exc
            finally:
                CURRENT.reset(token)
    except SemaphoreLeaseLostError:
        if not slot.lost.is_set():
            raise  # another semaphore's loss, inside the body: not ours to restate
        raise slot.lease_lost_error() from None
    finally:
        if semaphore_released.receivers:
            semaphore_released.send(
                sender=task,
                limit=slot.limit,
                slot=slot,
                held=time.monotonic() - started,
                lost=slot.lost.is_set(),
                **names.fields(),
            )
        if slot.lost.is_set():
            report_lease_lost(task, slot, names)
