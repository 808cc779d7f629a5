"""Prometheus metrics for bounded tasks (``pip install 'celery-semaphore[metrics]'``).

Call :func:`install` once in the module that defines your Celery app; it connects handlers
to :mod:`celery_semaphore.signals` in every process that imports that module::

    from celery_semaphore import metrics
    metrics.install()

==================================== ========= ==============================================
metric                               type      labels
==================================== ========= ==============================================
``semaphore_acquisitions_total``     counter   key, outcome (``acquired``/``shed``/``parked``/
                                               ``refused``)
``semaphore_sheds_total``            counter   key (re-queued: full, unreachable, lost+retry)
``semaphore_parked_total``           counter   key (runs parked in the waiting room)
``semaphore_refused_total``          counter   key, reason (why a run got no slot and failed:
                                               ``full``/``timeout``/``backend``/
                                               ``room_full``/``shutdown``/``paused``/
                                               ``backoff``)
``semaphore_lease_lost_total``       counter   key
``semaphore_renew_errors_total``     counter   key
``semaphore_back_offs_total``        counter   key (runs that backed off: a 429)
``semaphore_wait_seconds``           histogram key (time spent acquiring)
``semaphore_hold_seconds``           histogram key (time a body held its slot)
``semaphore_slots_held``             gauge     key (slots held by this process now)
==================================== ========= ==============================================

The waiting rooms live in Redis, not in any one process, so their gauges come from a
collector that reads Redis at each scrape: register a :class:`RoomCollector` once, in the
process that serves the metrics (see its docstring).

Label cardinality: a templated key (``"tenant:{tenant_id}"``) would make one series per
tenant, so by default the ``key`` label is the *template* (the ``semaphore`` option as
written) rather than the rendered key; static keys are their own template. Pass
``key_label`` to choose otherwise, for example ``key_label=lambda key, template: key`` for a
per-key series when the keys are few.

A run that holds several keys (``semaphore=[("openai", 20), ("tenant:{tenant_id}", 2)]``)
counts once under each key's own label: its acquisition, wait, hold, shed, park, refusal,
loss and held slot are seen in the ``openai`` series and in the ``tenant:{tenant_id}`` one,
never under a joined ``openai+tenant:{tenant_id}`` (see :func:`labels_of`).

Prefork workers run bodies in child processes, each with its own registry: use
prometheus-client's multiprocess mode (set ``PROMETHEUS_MULTIPROC_DIR``) and serve the
directory from the worker's main process, as prometheus-client documents. The gauge then
sums live processes (``multiprocess_mode="livesum"``) as prometheus-client judges them: call
its ``mark_process_dead(pid)`` when a pool process exits (``worker_process_shutdown``), or a
SIGKILLed one keeps counting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.admin import DEFAULT_PREFIX, SemaphoreAdmin
from ..core.live import read_rate_states
from ..core.room import WaitingRoom
from ..core.scripts import backend_errors
from ..errors import SemaphoreError
from ..integration import signals

logger = logging.getLogger(__name__)

KeyLabel = Callable[[str, str], str]


def template_label(key: str, template: str) -> str:
    """The default ``key`` label: the key's template (``key`` itself when it has none)."""
    return template or key


def labels_of(
    key_label: KeyLabel,
    key: str = "",
    template: str = "",
    keys: Sequence[str] = (),
    templates: Sequence[str] = (),
    **_: Any,
) -> list[str]:
    """The ``key`` labels a signal counts under: one per key the run holds, each from
    ``key_label(key, template)`` of that key and its own template, each label once (a
    ``key_label`` may map two keys to one). A signal sent without ``keys`` (by code of
    an older version) counts once, under its ``key`` and ``template``."""
    if not keys or len(keys) != len(templates):
        return [key_label(key, template)]
    return list(dict.fromkeys(key_label(k, t) for k, t in zip(keys, templates, strict=True)))


@dataclass(frozen=True)
class Metrics:
    """The installed collectors and the handlers feeding them (see :func:`install`)."""

    acquisitions: Counter
    sheds: Counter
    parked: Counter
    refused: Counter
    lease_lost: Counter
    renew_errors: Counter
    back_offs: Counter
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
    buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS,
) -> Metrics:
    """Create the collectors in ``registry`` and start feeding them from the signals.

    Args:
        registry (CollectorRegistry): where to register; default the global registry.
        key_label (Callable[[str, str], str]): maps (key, template) to the ``key`` label.
        namespace (str): prefix for the metric names, as prometheus-client uses it.
        buckets (Sequence[float]): histogram bucket bounds in seconds, for both the wait
            and the hold histograms; the default is prometheus-client's (up to 10 s).

    Returns:
        Metrics: the collectors, and ``uninstall()`` to stop feeding them.

    Raises:
        ValueError: the metrics are already registered in ``registry``.
    """
    opts: dict[str, Any] = {"registry": registry, "namespace": namespace}
    acquisitions = Counter(
        "semaphore_acquisitions", "Slot acquisitions by outcome.", ["key", "outcome"], **opts
    )
    sheds = Counter("semaphore_sheds", "Runs shed and re-queued.", ["key"], **opts)
    parked = Counter("semaphore_parked", "Runs parked in the waiting room.", ["key"], **opts)
    refused = Counter(
        "semaphore_refused", "Runs that got no slot and failed, by reason.", ["key", "reason"],
        **opts,
    )  # fmt: skip
    lease_lost = Counter("semaphore_lease_lost", "Slots lost while a body ran.", ["key"], **opts)
    renew_errors = Counter(
        "semaphore_renew_errors", "Renewal round trips that failed.", ["key"], **opts
    )
    back_offs = Counter(
        "semaphore_back_offs", "Runs that backed off: the provider was over its limit.", ["key"],
        **opts,
    )  # fmt: skip
    wait = Histogram(
        "semaphore_wait_seconds",
        "Seconds spent acquiring a slot.",
        ["key"],
        buckets=buckets,
        **opts,
    )
    hold = Histogram(
        "semaphore_hold_seconds", "Seconds a body held its slot.", ["key"], buckets=buckets, **opts
    )
    in_use = Gauge(
        "semaphore_slots_held",
        "Slots held by live processes now.",
        ["key"],
        multiprocess_mode="livesum",
        **opts,
    )

    def on_acquired(waited: float = 0.0, **fields: Any) -> None:
        for label in labels_of(key_label, **fields):
            acquisitions.labels(label, "acquired").inc()
            wait.labels(label).observe(waited)
            in_use.labels(label).inc()

    def on_released(held: float = 0.0, **fields: Any) -> None:
        for label in labels_of(key_label, **fields):
            hold.labels(label).observe(held)
            in_use.labels(label).dec()

    def on_refused(reason: object = "full", **fields: Any) -> None:
        for label in labels_of(key_label, **fields):
            acquisitions.labels(label, "refused").inc()
            refused.labels(label, str(reason)).inc()

    def counting(counter: Counter, outcome: str = "") -> Callable[..., None]:
        """A handler that counts a run under each of its labels in ``counter`` and, given an
        ``outcome``, in ``acquisitions``."""

        def handler(**fields: Any) -> None:
            for label in labels_of(key_label, **fields):
                if outcome:
                    acquisitions.labels(label, outcome).inc()
                counter.labels(label).inc()

        return handler

    handlers = (
        (signals.semaphore_acquired, on_acquired),
        (signals.semaphore_released, on_released),
        (signals.semaphore_shed, counting(sheds, "shed")),
        (signals.semaphore_parked, counting(parked, "parked")),
        (signals.semaphore_refused, on_refused),
        (signals.semaphore_lease_lost, counting(lease_lost)),
        (signals.semaphore_renew_failed, counting(renew_errors)),
        (signals.semaphore_backed_off, counting(back_offs)),
    )
    for signal, handler in handlers:
        signal.connect(handler, weak=False)
    return Metrics(
        acquisitions,
        sheds,
        parked,
        refused,
        lease_lost,
        renew_errors,
        back_offs,
        wait,
        hold,
        in_use,
        handlers,
    )


class RoomCollector(Collector):
    """Gauges of the waiting rooms, read from Redis at each scrape (one round trip per room
    with runs parked, plus one to list them).

    ==================================== ========= ==========================================
    metric                               type      labels
    ==================================== ========= ==========================================
    ``semaphore_queued``                 gauge     key (runs parked in its waiting room)
    ``semaphore_oldest_wait_seconds``    gauge     key (how long the oldest has waited)
    ``semaphore_rate_free_units``        gauge     key, rate (units of a start rate free now)
    ``semaphore_rate_next_due_seconds``  gauge     key, rate (until its next unit falls due)
    ``semaphore_limit_current``          gauge     key (its adaptive limit now)
    ``semaphore_cooling_until_seconds``  gauge     key (when its last cool-down ends, epoch s)
    ==================================== ========= ==========================================

    The ``key`` label is the rendered key: a room exists only while runs wait in it, so
    there is one series per key with a backlog. Register it once, where the metrics are
    served (a worker's main process, or a small exporter)::

        from prometheus_client import REGISTRY
        from celery_semaphore.metrics import RoomCollector
        from celery_semaphore.integration.settings import client_for

        REGISTRY.register(RoomCollector(client_for(app)))

    Args:
        client (redis.Redis): the Redis holding the semaphores.
        prefix (str): their key namespace (``semaphore_prefix``).
        namespace (str): prefix for the metric names, as for :func:`install`.

    A scrape that cannot reach Redis yields the gauges empty and logs a warning.
    """

    def __init__(
        self, client: redis.Redis, prefix: str = DEFAULT_PREFIX, namespace: str = ""
    ) -> None:
        self.room, self.admin = WaitingRoom(client, prefix), SemaphoreAdmin(client, prefix)
        self.namespace = f"{namespace}_" if namespace else ""

    def collect(self) -> Iterator[Metric]:
        """Yield ``semaphore_queued``, ``semaphore_oldest_wait_seconds``, the start rates'
        and the provider feedback's gauges of the keys with a backlog (two more round trips
        per such key, three when it has a rate: the store's clock)."""
        queued = GaugeMetricFamily(
            f"{self.namespace}semaphore_queued", "Runs parked in the waiting room.", labels=["key"]
        )
        oldest = GaugeMetricFamily(
            f"{self.namespace}semaphore_oldest_wait_seconds",
            "Seconds the oldest parked run has waited.",
            labels=["key"],
        )
        free = GaugeMetricFamily(
            f"{self.namespace}semaphore_rate_free_units",
            "Units of a start rate free now.",
            labels=["key", "rate"],
        )
        due = GaugeMetricFamily(f"{self.namespace}semaphore_rate_next_due_seconds",
                                "Seconds until a start rate's next unit falls due.",
                                labels=["key", "rate"])  # fmt: skip
        current = GaugeMetricFamily(f"{self.namespace}semaphore_limit_current",
                                    "The adaptive limit now.", labels=["key"])  # fmt: skip
        cooling = GaugeMetricFamily(f"{self.namespace}semaphore_cooling_until_seconds",
                                    "When the last back-off's cool-down ends (epoch s).",
                                    labels=["key"])  # fmt: skip
        try:
            for key in self.room.index.rooms():
                count, head = self.room.head(key)
                if not count:  # a room drained (or emptied) that its next sweep drops
                    continue
                queued.add_metric([key], count)
                if head is not None:
                    oldest.add_metric([key], head.waited)
                with backend_errors(key):
                    rates = read_rate_states(self.room.client, self.room.names.keys_of(key))
                fed = self.admin.feedback(key)
                if fed is not None and fed.limit is not None:
                    current.add_metric([key], fed.limit)
                if fed is not None and fed.back_offs:
                    cooling.add_metric([key], fed.cooling_until)
                for rate in rates:
                    if rate.left is not None:
                        free.add_metric([key, rate.name], rate.left)
                    due.add_metric([key, rate.name], rate.due_in)
        except SemaphoreError as exc:
            logger.warning("could not read the waiting rooms for metrics: %s", exc)
        yield from (queued, oldest, free, due, current, cooling)
