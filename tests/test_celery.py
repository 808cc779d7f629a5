"""The Celery integration against real workers (in-process and subprocess) and real Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.worker import WorkController

from celery_semaphore import (
    Semaphore,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreTask,
    current_slot,
)
from celery_semaphore.testing import RedisServer

from . import history
from .celery_apps import make_app
from .helpers import AMQP_URL, prefork_worker_process, rabbitmq_up, wait_for
from .history import BODIES, History

ROOT = Path(__file__).resolve().parent.parent


# Celery's celery_worker fixture (celery.contrib.pytest) runs the tests' app, on the shared
# server, in a thread pool of 8.
@pytest.fixture
def celery_app(app: Celery) -> Celery:
    return app


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters() -> dict[str, Any]:
    return {"concurrency": 8, "perform_ping_check": False}


@pytest.fixture
def threads_worker(celery_worker: WorkController) -> Celery:
    return celery_worker.app


@pytest.fixture
def solo_worker(app: Celery) -> Iterator[Celery]:
    with start_worker(app, pool="solo", perform_ping_check=False):
        yield app


@pytest.fixture
def prefork_process(app: Celery, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A `celery worker -P prefork -c 4` subprocess, ready to take tasks."""
    with prefork_worker_process(app, tmp_path / "worker.log") as proc:
        yield proc


@pytest.fixture
def prefork_worker(app: Celery, prefork_process: subprocess.Popen[bytes]) -> Celery:
    return app


WORKERS = ["threads_worker", "prefork_worker"]


def _semaphore(app: Celery, limit: int = 1) -> Semaphore:
    return Semaphore(app.conf.semaphore_url, limit=limit)


@pytest.mark.parametrize("worker", WORKERS)
def test_30_tasks_on_limit_3_never_exceed_3(
    worker: str, request: pytest.FixtureRequest, client: redis.Redis
) -> None:
    app: Celery = request.getfixturevalue(worker)
    task = app.tasks["csem.provider_call"]
    results = [task.delay(n, 0.2) for n in range(30)]
    values = [r.get(timeout=120) for r in results]
    assert sorted(v["n"] for v in values) == list(range(30))
    report = History.load(client, BODIES).assert_ok({"provider": 3}, tasks=[r.id for r in results])
    assert report.peaks["provider"] >= 2, "the worker never ran tasks side by side"
    # Shedding happened, and none of it counted against max_retries=0.
    assert any(v["sheds"] for v in values)
    assert all(v["retries"] == 0 for v in values)
    # A run in a worker sends its release after it returns: wait for it.
    assert wait_for(lambda: _semaphore(app).count("provider") == 0, timeout=10)


def test_solo_pool_runs_bounded_tasks(solo_worker: Celery, client: redis.Redis) -> None:
    task = solo_worker.tasks["csem.provider_call"]
    results = [task.delay(n, 0.01) for n in range(5)]
    assert [r.get(timeout=60)["n"] for r in results] == [0, 1, 2, 3, 4]
    History.load(client, BODIES).assert_ok({"provider": 3}, tasks=[r.id for r in results])
    # A run in a worker sends its release after it returns: wait for it.
    assert wait_for(lambda: _semaphore(solo_worker).count("provider") == 0, timeout=10)


def test_decorator_bounds_a_plain_task(threads_worker: Celery, client: redis.Redis) -> None:
    task = threads_worker.tasks["csem.legacy"]
    results = [task.delay(n, 0.1) for n in range(12)]
    assert sorted(r.get(timeout=60) for r in results) == list(range(12))
    History.load(client, BODIES).assert_ok({"legacy": 2}, tasks=[r.id for r in results])


def test_key_templates_give_each_tenant_its_own_limit(
    threads_worker: Celery, client: redis.Redis
) -> None:
    task = threads_worker.tasks["csem.per_tenant"]
    results = [task.delay(tenant, 0.2) for tenant in ["a", "b"] * 4]
    assert sorted(r.get(timeout=60) for r in results) == ["a"] * 4 + ["b"] * 4
    runs = History.load(client, BODIES)
    runs.assert_ok({"tenant:a": 1, "tenant:b": 1}, tasks=[r.id for r in results])
    assert runs.peak() == 2, "tenants a and b never ran at the same time"


@pytest.mark.parametrize("worker", WORKERS)
def test_a_task_that_raises_releases_its_slot(worker: str, request: pytest.FixtureRequest) -> None:
    app: Celery = request.getfixturevalue(worker)
    result = app.tasks["csem.failing"].delay()
    with pytest.raises(ValueError, match="the body failed"):
        result.get(timeout=60)
    # A run in a worker sends its release after it returns: wait for it.
    assert wait_for(lambda: _semaphore(app).count("boom") == 0, timeout=10)


@pytest.mark.parametrize("worker", WORKERS)
def test_a_task_that_retries_itself_releases_its_slot(
    worker: str, request: pytest.FixtureRequest
) -> None:
    app: Celery = request.getfixturevalue(worker)
    # limit=1: the second run could not start if the first had kept its slot.
    assert app.tasks["csem.self_retry"].delay().get(timeout=60) == 1
    # A run in a worker sends its release after it returns: wait for it.
    assert wait_for(lambda: _semaphore(app).count("again") == 0, timeout=10)


def test_lease_lost_fails_the_task_by_default(threads_worker: Celery, client: redis.Redis) -> None:
    result = threads_worker.tasks["csem.lost_raise"].delay()
    assert wait_for(lambda: History.load(client, BODIES).runs, timeout=30)
    assert _semaphore(threads_worker).admin.force_release_all("lost-raise") == 1
    with pytest.raises(SemaphoreLeaseLostError) as info:
        result.get(timeout=60)
    assert "lost-raise" in str(info.value)
    History.load(client, BODIES).assert_ok({"lost-raise": 1}, tasks=[result.id], lost=[result.id])


def test_lease_lost_can_shed_the_task_to_run_again(
    threads_worker: Celery, client: redis.Redis
) -> None:
    result = threads_worker.tasks["csem.lost_retry"].delay()
    assert wait_for(lambda: History.load(client, BODIES).runs, timeout=30)
    assert _semaphore(threads_worker).admin.force_release_all("lost-retry") == 1
    assert result.get(timeout=60) == "second run"
    History.load(client, BODIES).assert_ok(
        {"lost-retry": 1},
        tasks=[result.id],
        lost=[result.id],
        repeats={"on_lease_lost='retry' runs the body again": [result.id]},
    )


def test_a_killed_prefork_child_frees_its_slot_long_before_its_lease(
    prefork_worker: Celery, client: redis.Redis
) -> None:
    from billiard.exceptions import WorkerLostError

    result = prefork_worker.tasks["csem.sleepy"].delay(120)
    assert wait_for(lambda: History.load(client, BODIES).runs, timeout=60)
    sem = _semaphore(prefork_worker)
    [holder] = sem.admin.holders("sleepy")
    assert holder.metadata["task_id"] == result.id
    [run] = History.load(client, BODIES).runs
    assert holder.metadata["pid"] == run.pid
    os.kill(run.pid, signal.SIGKILL)
    # The lease is 30 s; the worker's main process frees the slot as soon as it sees the death.
    assert wait_for(lambda: sem.count("sleepy") == 0, timeout=15)
    with pytest.raises(WorkerLostError):
        result.get(timeout=30)
    History.load(client, BODIES).assert_ok({"sleepy": 1}, tasks=[], killed=[result.id])


def test_warm_shutdown_lets_a_running_task_finish_and_keep_renewing(
    app: Celery, prefork_process: subprocess.Popen[bytes], client: redis.Redis
) -> None:
    # A 1 s lease and a 4 s body: without renewal during the drain the slot would lapse.
    result = app.tasks["csem.long_body"].delay(4.0)
    assert wait_for(lambda: History.load(client, BODIES).runs, timeout=60)
    prefork_process.send_signal(signal.SIGTERM)
    assert result.get(timeout=60) == "kept"
    assert prefork_process.wait(timeout=60) == 0
    History.load(client, BODIES).assert_ok({"long": 1}, tasks=[result.id])
    assert _semaphore(app).count("long") == 0


def test_eager_and_direct_calls_wait_then_raise(redis_server: RedisServer) -> None:
    app = make_app(redis_server.url, task_always_eager=True, semaphore_queue_timeout=0.3)
    task: Any = app.tasks["csem.per_tenant"]
    assert task.delay("x", 0).get() == "x"
    assert task("x", 0) == "x"
    holder = _semaphore(app).acquire("tenant:x")
    assert holder is not None
    with pytest.raises(SemaphoreNotAcquiredError, match="outside a worker"):
        task.delay("x", 0).get()
    with pytest.raises(SemaphoreNotAcquiredError):
        task("x", 0)
    with pytest.raises(SemaphoreNotAcquiredError):
        task.apply(("x", 0)).get()
    assert task("y", 0) == "y"
    holder.release()


def test_current_slot_outside_a_bounded_body_is_none() -> None:
    assert current_slot() is None


def test_the_body_can_be_interrupted_when_its_slot_is_lost(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    app = make_app(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="spin", limit=1, lease=2.0, heartbeat=0.1,
              interrupt=True, shared=False, name="csem.spin")  # fmt: skip
    def spin() -> str:
        with history.run(client, BODIES, "spin", slot=current_slot(), mark_start=True):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pass  # pure Python: the interrupt lands at the next bytecode
        return "ran to the end"

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = spin.delay()
        assert wait_for(lambda: History.load(client, BODIES).runs, timeout=30)
        _semaphore(app).admin.force_release_all("spin")
        with pytest.raises(SemaphoreLeaseLostError):
            result.get(timeout=20)
    History.load(client, BODIES).assert_ok({"spin": 1}, tasks=[result.id], lost=[result.id])


@pytest.mark.skipif(not rabbitmq_up(), reason="no RabbitMQ on 127.0.0.1:5672")
def test_works_with_a_rabbitmq_broker(redis_server: RedisServer, client: redis.Redis) -> None:
    queue = f"csem-test-{uuid.uuid4().hex[:8]}"
    app = make_app(
        redis_server.url,
        broker_url=AMQP_URL,
        task_default_queue=queue,
    )
    with start_worker(app, pool="threads", concurrency=6, perform_ping_check=False):
        task = app.tasks["csem.provider_call"]
        results = [task.delay(n, 0.1) for n in range(12)]
        values = [r.get(timeout=120) for r in results]
    assert sorted(v["n"] for v in values) == list(range(12))
    History.load(client, BODIES).assert_ok({"provider": 3}, tasks=[r.id for r in results])
    assert any(v["sheds"] for v in values)


def test_calling_run_directly_uses_the_tasks_own_app(redis_server: RedisServer) -> None:
    other = RedisServer().start()
    try:
        app = make_app(redis_server.url)
        # A different app is current, pointing at another Redis.
        decoy = Celery("decoy", broker=other.url, set_as_current=True)
        task: Any = app.tasks["csem.per_tenant"]
        assert task.run("z", 0) == "z"
        assert Semaphore(other.url, limit=1).count("tenant:z") == 0
        held = _semaphore(app).acquire("tenant:z")
        assert held is not None
        with pytest.raises(SemaphoreNotAcquiredError):
            task.run("z", 0)
        held.release()
        decoy.close()
    finally:
        other.close()


def test_a_quick_rerun_of_a_shed_task_is_never_reported_as_retry(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    # Countdown 0 and instant bodies: a shed task's re-run often finishes before the shed
    # run has ended. Its SUCCESS must stand (result.get() must return), for every task.
    app = make_app(redis_server.url, semaphore_shed_countdown=0.0, semaphore_shed_backoff=False)
    with start_worker(app, pool="threads", concurrency=8, perform_ping_check=False):
        task = app.tasks["csem.per_tenant"]
        results = [task.delay("race", 0) for _ in range(80)]
        assert [r.get(timeout=120) for r in results] == ["race"] * 80
        assert {r.state for r in results} == {"SUCCESS"}
    History.load(client, BODIES).assert_ok({"tenant:race": 1}, tasks=[r.id for r in results])


def test_shed_tasks_in_chords_chains_and_groups_complete(
    threads_worker: Celery, client: redis.Redis
) -> None:
    from celery import chain, chord, group

    app = threads_worker
    total = app.tasks["csem.total"]
    # A limit of 1 sheds most of these; the canvas must still complete, each run once.
    task = app.tasks["csem.per_tenant"]
    assert (
        chord(group(task.s("c", 0.05) for _ in range(5)), total.s()).delay().get(timeout=120)
        == ["c"] * 5
    )
    assert chain(task.si("d", 0.05), task.si("d", 0.05)).delay().get(timeout=120) == "d"
    assert group(task.s("e", 0.05) for _ in range(4)).delay().get(timeout=120) == ["e"] * 4
    runs = History.load(client, BODIES)
    runs.assert_ok({"tenant:c": 1, "tenant:d": 1, "tenant:e": 1})  # each task's body once
    assert [len(runs.of(f"tenant:{t}").runs) for t in "cde"] == [5, 2, 4]


def test_a_task_with_autoretry_for_is_shed_too(threads_worker: Celery, client: redis.Redis) -> None:
    # autoretry_for makes Celery keep the bound run aside; binding again must not replace it.
    task = threads_worker.tasks["csem.autoretry"]
    results = [task.delay(0.1) for _ in range(6)]
    values = [r.get(timeout=120) for r in results]
    assert any(v["sheds"] for v in values)
    History.load(client, BODIES).assert_ok({"auto": 1}, tasks=[r.id for r in results])
