"""A run that holds several keys, as the signals and the Prometheus metrics see it: the
signals keep ``key`` and ``template`` joined with ``+`` and add ``keys`` and ``templates``
apart, and every metric counts the run once under each key's own label, on real
prometheus-client registries, real Redis and a real worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from prometheus_client import CollectorRegistry

from celery_semaphore import (
    Semaphore,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreTask,
    bounded,
    current_slot,
    metrics,
    signals,
)
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import wait_for
from .test_telemetry import value

MANY = [("provider", 3), ("tenant:{tenant}", 1)]
LABELS = ("provider", "tenant:{tenant}")
JOINED = "provider+tenant:{tenant}"


@pytest.fixture
def sent() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every semaphore signal sent during the test: (name, keyword arguments)."""
    found: list[tuple[str, dict[str, Any]]] = []
    lock = threading.Lock()
    handlers = []
    for name in signals.__all__:
        signal = getattr(signals, name)

        def handler(name: str = name, **kwargs: Any) -> None:
            with lock:
                found.append((name, kwargs))

        signal.connect(handler, weak=False)
        handlers.append((signal, handler))
    yield found
    for signal, handler in handlers:
        signal.disconnect(handler)


def test_signals_name_every_key_apart_and_keep_the_joined_key(
    redis_server: RedisServer, sent: list[tuple[str, dict[str, Any]]]
) -> None:
    @bounded(MANY, redis=redis_server.url)
    def call(tenant: str) -> str:
        return tenant

    @bounded("solo:{tenant}", 1, redis=redis_server.url)
    def solo(tenant: str) -> str:
        return tenant

    assert call("a") == "a"
    assert solo("b") == "b"
    acquired = [kwargs for name, kwargs in sent if name == "semaphore_acquired"]
    released = [kwargs for name, kwargs in sent if name == "semaphore_released"]
    assert len(acquired) == len(released) == 2
    for kwargs in (acquired[0], released[0]):
        assert kwargs["key"] == "provider+tenant:a"
        assert kwargs["template"] == JOINED
        assert kwargs["keys"] == ["provider", "tenant:a"]
        assert kwargs["templates"] == list(LABELS)
        assert kwargs["limit"] == 3  # the first key's, as before
    for kwargs in (acquired[1], released[1]):
        assert (kwargs["key"], kwargs["template"]) == ("solo:b", "solo:{tenant}")
        assert (kwargs["keys"], kwargs["templates"]) == (["solo:b"], ["solo:{tenant}"])
    # A refusal names every key too.
    sem = Semaphore(redis_server.url, limit=1)
    blocker = sem.acquire("tenant:a")
    with pytest.raises(SemaphoreNotAcquiredError):
        call("a")
    [refused] = [kwargs for name, kwargs in sent if name == "semaphore_refused"]
    assert refused["keys"] == ["provider", "tenant:a"]
    assert refused["templates"] == list(LABELS)
    assert blocker is not None
    assert blocker.release()


def test_a_run_of_several_keys_counts_once_under_each_key(
    redis_server: RedisServer, registry: CollectorRegistry
) -> None:
    @bounded(MANY, redis=redis_server.url, lease=2.0, heartbeat=0.1)
    def call(tenant: str, lose: bool = False) -> str:
        if lose:  # an operator frees the tenant's slot while the body runs
            Semaphore(redis_server.url, limit=1).admin.force_release_all(f"tenant:{tenant}")
            slot = current_slot()
            assert slot is not None
            assert slot.lost.wait(30)
        time.sleep(0.01)
        return tenant

    assert [call(t) for t in ("a", "b", "a")] == ["a", "b", "a"]
    sem = Semaphore(redis_server.url, limit=1)
    blocker = sem.acquire("tenant:c")
    with pytest.raises(SemaphoreNotAcquiredError):
        call("c")
    assert blocker is not None
    assert blocker.release()
    with pytest.raises(SemaphoreLeaseLostError):
        call("d", lose=True)
    for label in LABELS:
        key = {"key": label}
        assert value(registry, "semaphore_acquisitions_total", outcome="acquired", **key) == 4
        assert value(registry, "semaphore_acquisitions_total", outcome="refused", **key) == 1
        assert value(registry, "semaphore_wait_seconds_count", **key) == 4
        assert value(registry, "semaphore_hold_seconds_count", **key) == 4
        assert value(registry, "semaphore_hold_seconds_sum", **key) >= 3 * 0.01
        assert value(registry, "semaphore_lease_lost_total", **key) == 1
        assert value(registry, "semaphore_slots_held", **key) == 0
    # Nothing is counted under the joined label any more.
    for name in ("semaphore_acquisitions_total", "semaphore_hold_seconds_count"):
        assert registry.get_sample_value(name, {"key": JOINED, "outcome": "acquired"}) is None
        assert registry.get_sample_value(name, {"key": JOINED}) is None


def test_a_key_label_that_maps_two_keys_to_one_counts_the_run_once(
    redis_server: RedisServer,
) -> None:
    registry = CollectorRegistry()
    installed = metrics.install(registry, key_label=lambda key, template: "all")
    try:

        @bounded([("x", 2), ("y", 2)], redis=redis_server.url)
        def call() -> None: ...

        call()
        assert value(registry, "semaphore_acquisitions_total", key="all", outcome="acquired") == 1
        assert value(registry, "semaphore_slots_held", key="all") == 0
    finally:
        installed.uninstall()


def test_worker_runs_of_several_keys_park_and_shed_under_each_key(
    redis_server: RedisServer, registry: CollectorRegistry
) -> None:
    app = make_app(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore=MANY, shared=False, name="keys.queued")
    def queued(tenant: str) -> str:
        return tenant

    @app.task(base=SemaphoreTask, semaphore=MANY, on_full="retry", shared=False,
              name="keys.shed")  # fmt: skip
    def shed(tenant: str) -> str:
        return tenant

    sem = Semaphore(redis_server.url, limit=1)
    blockers = [sem.acquire("tenant:a"), sem.acquire("tenant:b")]
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        parked_run = queued.delay("a")  # parks in tenant:a's room
        shed_run = shed.delay("b")  # shed with a countdown while tenant:b is held
        for label in LABELS:
            assert wait_for(lambda label=label: value(registry, "semaphore_parked_total",
                                                      key=label) == 1)  # fmt: skip
            assert wait_for(lambda label=label: value(registry, "semaphore_sheds_total",
                                                      key=label) >= 1)  # fmt: skip
        for blocker in blockers:
            assert blocker is not None
            assert blocker.release()
        assert parked_run.get(timeout=60) == "a"
        assert shed_run.get(timeout=60) == "b"
    for label in LABELS:
        key = {"key": label}
        assert value(registry, "semaphore_acquisitions_total", outcome="parked", **key) == 1
        sheds = value(registry, "semaphore_sheds_total", **key)
        assert value(registry, "semaphore_acquisitions_total", outcome="shed", **key) == sheds
        assert value(registry, "semaphore_acquisitions_total", outcome="acquired", **key) == 2
        assert value(registry, "semaphore_slots_held", **key) == 0
    # Both keys saw the same sheds of the same run.
    assert len({value(registry, "semaphore_sheds_total", key=label) for label in LABELS}) == 1
    app.close()


def test_a_failed_renewal_of_several_keys_is_one_error_under_each_key(
    own_redis: RedisServer, registry: CollectorRegistry, sent: list[tuple[str, dict[str, Any]]]
) -> None:
    # A 0.2 s socket timeout and a 0.7 s CLIENT PAUSE make renewal round trips fail.
    client = own_redis.client(socket_timeout=0.2, retry=None)
    admin = own_redis.client()

    @bounded(MANY, redis=client, lease=3.0, heartbeat=0.3)
    def call(tenant: str) -> str:
        admin.execute_command("CLIENT", "PAUSE", "700", "WRITE")
        assert wait_for(lambda: any(name == "semaphore_renew_failed" for name, _ in sent), 10)
        time.sleep(1.0)  # the pause is over: the release gets through
        return tenant

    assert call("a") == "a"
    failed = [kwargs for name, kwargs in sent if name == "semaphore_renew_failed"]
    assert failed
    assert failed[0]["keys"] == ["provider", "tenant:a"]
    # One signal per failed round trip, though it carried the slots of both keys.
    assert len({id(kwargs["error"]) for kwargs in failed}) == len(failed)
    for label in LABELS:
        assert value(registry, "semaphore_renew_errors_total", key=label) == len(failed)
    client.close()
    admin.close()
