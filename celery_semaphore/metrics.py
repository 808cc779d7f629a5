"""Prometheus metrics for bounded tasks (``pip install 'celery-semaphore[metrics]'``).

Call :func:`install` once in the module that defines your Celery app; it connects handlers
to :mod:`celery_semaphore.signals` in every process that imports that module::

    from celery_semaphore import metrics
    metrics.install()

==================================== ========= ==============================================
metric                               type      labels
==================================== ========= ==============================================
``semaphore_acquisitions_total``     counter   key, outcome (``acquired`` / ``shed``)
``semaphore_sheds_total``            counter   key
``semaphore_lease_lost_total``       counter   key
``semaphore_renew_errors_total``     counter   key
``semaphore_wait_seconds``           histogram key (time spent acquiring)
``semaphore_hold_seconds``           histogram key (time a body held its slot)
``semaphore_slots_held``             gauge     key (slots held by this process now)
==================================== ========= ==============================================

Label cardinality: a templated key (``"tenant:{tenant_id}"``) would make one series per
tenant, so by default the ``key`` label is the task's *template* rather than the rendered
key; static keys are their own template. Pass ``key_label`` to choose otherwise, for example
``key_label=lambda task, key: key`` for a per-key series when the keys are few.

Prefork workers run bodies in child processes, each with its own registry: use
prometheus-client's multiprocess mode (set ``PROMETHEUS_MULTIPROCESS_DIR``) and serve the
directory from the worker's main process, as prometheus-client documents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from . import signals
from .worker import bounded_of

KeyLabel = Callable[[Any, str], str]


def template_label(task: Any, key: str) -> str:
    """The default ``key`` label: the task's key template if it has one, else ``key``."""
    found = bounded_of(task) if task is not None else None
    return found[0].key.source if found is not None else key


@dataclass(frozen=True)
class Metrics:
    """The installed collectors and the handlers feeding them (see :func:`install`)."""

    acquisitions: Counter
    sheds: Counter
    lease_lost: Counter
    renew_errors: Counter
    wait: Histogram
    hold: Histogram
    held: Gauge
    handlers: tuple[tuple[Any, Callable[..., None]], ...]

    def uninstall(self) -> None:
        """Disconnect the handlers (the collectors stay registered)."""
        for signal, handler in self.handlers:
            signal.disconnect(handler)


def install(
    registry: CollectorRegistry = REGISTRY,
    key_label: KeyLabel = template_label,
    namespace: str = "",
) -> Metrics:
    """Create the collectors in ``registry`` and start feeding them from the signals.

    Args:
        registry (CollectorRegistry): where to register; default the global registry.
        key_label (Callable[[Task | None, str], str]): maps (task, key) to the ``key`` label.
        namespace (str): prefix for the metric names, as prometheus-client uses it.

    Returns:
        Metrics: the collectors, and ``uninstall()`` to stop feeding them.

    Raises:
        ValueError: the metrics are already registered in ``registry``.
    """
    opts: dict[str, Any] = {"registry": registry, "namespace": namespace}
    acquisitions = Counter(
        "semaphore_acquisitions", "Slot acquisitions by outcome.", ["key", "outcome"], **opts
    )
    sheds = Counter("semaphore_sheds", "Runs shed because every slot was held.", ["key"], **opts)
    lease_lost = Counter("semaphore_lease_lost", "Slots lost while a body ran.", ["key"], **opts)
    renew_errors = Counter(
        "semaphore_renew_errors", "Renewal round trips that failed.", ["key"], **opts
    )
    wait = Histogram("semaphore_wait_seconds", "Seconds spent acquiring a slot.", ["key"], **opts)
    hold = Histogram("semaphore_hold_seconds", "Seconds a body held its slot.", ["key"], **opts)
    in_use = Gauge("semaphore_slots_held", "Slots held by this process now.", ["key"], **opts)

    def on_acquired(sender: Any = None, key: str = "", waited: float = 0.0, **_: Any) -> None:
        label = key_label(sender, key)
        acquisitions.labels(label, "acquired").inc()
        wait.labels(label).observe(waited)
        in_use.labels(label).inc()

    def on_released(sender: Any = None, key: str = "", held: float = 0.0, **_: Any) -> None:
        label = key_label(sender, key)
        hold.labels(label).observe(held)
        in_use.labels(label).dec()

    def on_shed(sender: Any = None, key: str = "", **_: Any) -> None:
        label = key_label(sender, key)
        acquisitions.labels(label, "shed").inc()
        sheds.labels(label).inc()

    def on_lost(sender: Any = None, key: str = "", **_: Any) -> None:
        lease_lost.labels(key_label(sender, key)).inc()

    def on_renew_failed(sender: Any = None, key: str = "", **_: Any) -> None:
        renew_errors.labels(key_label(sender, key)).inc()

    handlers = (
        (signals.semaphore_acquired, on_acquired),
        (signals.semaphore_released, on_released),
        (signals.semaphore_shed, on_shed),
        (signals.semaphore_lease_lost, on_lost),
        (signals.semaphore_renew_failed, on_renew_failed),
    )
    for signal, handler in handlers:
        signal.connect(handler, weak=False)
    return Metrics(acquisitions, sheds, lease_lost, renew_errors, wait, hold, in_use, handlers)
