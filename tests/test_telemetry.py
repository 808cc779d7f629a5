"""Prometheus metrics and OpenTelemetry spans, fed by real tasks on a real worker."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from prometheus_client import CollectorRegistry

from celery_semaphore import (
    Semaphore,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    bounded,
    metrics,
)
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import wait_for
from .history import BODIES, History


@pytest.fixture
def app(redis_server: RedisServer) -> Iterator[Celery]:
    app = make_app(redis_server.url)
    with start_worker(app, pool="threads", concurrency=6, perform_ping_check=False):
        yield app


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_metrics_count_acquisitions_sheds_and_holds(
    registry: CollectorRegistry, app: Celery
) -> None:
    task = app.tasks["csem.provider_call"]
    [r.get(timeout=60) for r in [task.delay(n, 0.2) for n in range(9)]]
    key = {"key": "provider"}
    assert value(registry, "semaphore_acquisitions_total", outcome="acquired", **key) == 9
    sheds = value(registry, "semaphore_sheds_total", **key)
    assert sheds > 0
    assert value(registry, "semaphore_acquisitions_total", outcome="shed", **key) == sheds
    assert value(registry, "semaphore_hold_seconds_count", **key) == 9
    assert value(registry, "semaphore_hold_seconds_sum", **key) >= 9 * 0.2
    assert value(registry, "semaphore_wait_seconds_count", **key) == 9
    assert value(registry, "semaphore_slots_held", **key) == 0


def test_parked_runs_are_counted_and_the_rooms_are_gauged_from_redis(
    registry: CollectorRegistry, app: Celery, redis_server: RedisServer
) -> None:
    sem = Semaphore(redis_server.url, limit=3)
    held = [sem.acquire("queued") for _ in range(3)]
    rooms = CollectorRegistry()
    rooms.register(metrics.RoomCollector(redis_server.client()))
    assert value(rooms, "semaphore_queued", key="queued") == 0
    results = [app.tasks["csem.queued"].delay(n, 0.0) for n in range(4)]
    assert wait_for(lambda: value(rooms, "semaphore_queued", key="queued") == 4, timeout=30)
    # Counted once each park has returned (and journaled its run), a moment after the room.
    assert wait_for(lambda: value(registry, "semaphore_parked_total", key="queued") == 4)
    assert value(registry, "semaphore_acquisitions_total", key="queued", outcome="parked") == 4
    assert wait_for(lambda: value(rooms, "semaphore_oldest_wait_seconds", key="queued") > 0.1)
    for slot in held:
        assert slot is not None
        slot.release()
    assert [r.get(timeout=60) for r in results] == [0, 1, 2, 3]
    # Each waited, parked, for at least the 0.1 s above: the wait counts from the first ask.
    assert value(registry, "semaphore_wait_seconds_sum", key="queued") >= 0.4
    assert wait_for(lambda: rooms.get_sample_value("semaphore_queued", {"key": "queued"}) is None)


def test_templated_keys_are_labelled_by_their_template(
    registry: CollectorRegistry, app: Celery
) -> None:
    task = app.tasks["csem.per_tenant"]
    [r.get(timeout=60) for r in [task.delay(t, 0) for t in ["a", "b", "c"]]]
    labels = {"key": "tenant:{tenant_id}", "outcome": "acquired"}
    assert value(registry, "semaphore_acquisitions_total", **labels) == 3
    assert value(registry, "semaphore_acquisitions_total", key="tenant:a", outcome="acquired") == 0


def test_lease_loss_is_counted(
    registry: CollectorRegistry, app: Celery, client: redis.Redis, redis_server: RedisServer
) -> None:
    result = app.tasks["csem.lost_raise"].delay()
    assert wait_for(lambda: History.load(client, BODIES).runs, timeout=30)
    Semaphore(redis_server.url, limit=1).admin.force_release_all("lost-raise")
    with pytest.raises(SemaphoreLeaseLostError):
        result.get(timeout=60)
    assert value(registry, "semaphore_lease_lost_total", key="lost-raise") == 1
    assert value(registry, "semaphore_slots_held", key="lost-raise") == 0


def test_each_acquire_is_a_span_with_attempts_and_outcome(redis_server: RedisServer) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another test set the global tracer provider first")
    sem = Semaphore(redis_server.url, limit=1)
    slot = sem.acquire("traced")
    assert slot is not None
    assert sem.acquire("traced", retries=2, retry_delay=0.01) is None
    slot.release()
    first, second = exporter.get_finished_spans()
    assert first.name == second.name == "semaphore.acquire"
    assert dict(first.attributes or {}) == {
        "semaphore.key": "traced",
        "semaphore.limit": 1,
        "semaphore.attempts": 1,
        "semaphore.outcome": "acquired",
    }
    assert (second.attributes or {})["semaphore.attempts"] == 3
    assert (second.attributes or {})["semaphore.outcome"] == "full"
    exporter.clear()
    # The waiting room's park and claim (what a worker's run does by default) are spans too.
    holder = sem.acquire("traced")
    assert holder is not None
    sem.room.park("traced", "w1", b"p")
    holder.release()  # reserves the slot for w1 (no publisher: the sweep would start it)
    outcomes = [(s.attributes or {})["semaphore.outcome"] for s in exporter.get_finished_spans()]
    assert outcomes == ["acquired", "parked"]
    exporter.clear()
    # Several keys at once are one span, which names them joined and apart, sync or asyncio.
    group = sem.acquire_many([("traced", 2), ("tenant:a", 1)])
    assert group is not None
    assert sem.room.park_many([("traced", 2), ("tenant:a", 1)], "w2", b"p") is not None

    async def from_asyncio() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as asem:
            taken = await asem.acquire_many([("traced", 3), ("tenant:b", 1)])
            assert taken is not None
            assert await taken.release()

    asyncio.run(from_asyncio())
    assert group.release()
    spans = [dict(s.attributes or {}) for s in exporter.get_finished_spans()]
    named = [(s["semaphore.key"], s["semaphore.keys"]) for s in spans]
    assert named == [("traced+tenant:a", ("traced", "tenant:a"))] * 2 + [
        ("traced+tenant:b", ("traced", "tenant:b"))
    ]
    assert [s["semaphore.outcome"] for s in spans] == ["acquired", "parked", "acquired"]
    exporter.clear()
    # A run that is refused says why on the span current then (a task's own span, say).

    @bounded("traced-refused", 1, redis=redis_server.url)
    def plain() -> None: ...

    holder = sem.acquire("traced-refused")
    assert holder is not None
    with (
        trace.get_tracer("test").start_as_current_span("task"),
        pytest.raises(SemaphoreNotAcquiredError),
    ):
        plain()
    holder.release()
    (task_span,) = [s for s in exporter.get_finished_spans() if s.name == "task"]
    (event,) = task_span.events
    assert event.name == "semaphore.refused"
    assert dict(event.attributes or {}) == {
        "semaphore.key": "traced-refused",
        "semaphore.limit": 1,
        "semaphore.refusal": "full",
    }
