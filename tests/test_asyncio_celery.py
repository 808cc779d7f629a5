"""``@bounded`` on an ``async def``: coroutines and Celery tasks share one key's slots.

Bodies record when they start and end (``time.monotonic``, one clock for the whole process):
the tasks' in Redis, the coroutines' in a list. The peak is computed from those intervals,
outside the library.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import (
    Semaphore,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
    bounded,
)
from celery_semaphore.testing import RedisServer, unbounded

from . import history
from .helpers import wait_for
from .test_asyncio import run

LIMIT = 3


def _app(url: str, **conf: Any) -> Celery:
    app = Celery("csem_async", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_backend_max_retries=2,
        **conf,
    )
    return app


@pytest.fixture
def mixed_app(redis_server: RedisServer) -> Iterator[Celery]:
    app = _app(redis_server.url, semaphore_url=redis_server.url)
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(shared=False, name="csem_async.mixed")
    @bounded("mixed", LIMIT)
    def mixed(n: int, duration: float) -> int:
        with history.run(recorder, history.BODIES, "mixed"):
            time.sleep(duration)
        return n

    yield app
    recorder.close()
    gc.collect()  # AsyncResults talk to the backend in __del__: while the server is up
    app.close()


def test_a_threads_worker_and_50_coroutines_never_exceed_the_limit(
    mixed_app: Celery, client: redis.Redis
) -> None:
    @bounded("mixed", LIMIT, app=mixed_app, on_full="wait", wait_timeout=120)
    async def handler(n: int, duration: float) -> int:
        with history.run(client, history.BODIES, "mixed", task_id=f"coroutine-{n}"):
            await asyncio.sleep(duration)
        return n

    async def drive() -> list[int]:
        return list(await asyncio.gather(*(handler(n, 0.1) for n in range(50))))

    task = mixed_app.tasks["csem_async.mixed"]
    with start_worker(mixed_app, pool="threads", concurrency=4, perform_ping_check=False):
        results = [task.delay(n, 0.2) for n in range(20)]
        assert run(drive) == list(range(50))
        assert [r.get(timeout=120) for r in results] == list(range(20))
    bodies = history.History.load(client, history.BODIES)
    report = bodies.assert_ok(
        {"mixed": LIMIT}, tasks=[r.id for r in results] + [f"coroutine-{n}" for n in range(50)]
    )
    assert report.peaks["mixed"] >= 2, report
    # Both kinds really ran side by side, not one after the other.
    spans = [r for r in bodies.completed if r.task_id.startswith("coroutine-")]
    tasks = [r for r in bodies.completed if not r.task_id.startswith("coroutine-")]
    assert any(s.start < (t.end or 0) and t.start < (s.end or 0) for s in spans for t in tasks)
    # The tasks' runs send their releases after they return: wait for them.
    assert wait_for(lambda: Semaphore(client, limit=LIMIT).count("mixed") == 0, timeout=10)


def test_a_bounded_coroutine_counts_against_the_tasks_key(redis_server: RedisServer) -> None:
    app = _app(redis_server.url, semaphore_prefix="custom")  # the broker is the store
    sync = Semaphore(redis_server.url, limit=2, prefix="custom")

    @bounded("tenant:{tenant_id}", 2, app=app)
    async def fetch(tenant_id: str, extra: int = 0) -> list[str]:
        return [h.metadata["host"] for h in sync.admin.holders(f"tenant:{tenant_id}")]

    assert inspect.iscoroutinefunction(fetch)
    assert list(inspect.signature(fetch).parameters) == ["tenant_id", "extra"]
    assert fetch.__name__ == "fetch"

    async def main() -> None:
        assert len(await fetch("a")) == 1  # the sync semaphore sees the coroutine's slot
        held = [sync.acquire("tenant:a"), sync.acquire("tenant:a")]
        with pytest.raises(SemaphoreNotAcquiredError) as info:
            await fetch("a")  # fails fast by default
        assert info.value.key == "tenant:a"
        assert len(await fetch(tenant_id="b")) == 1
        for slot in held:
            assert slot is not None
            slot.release()

    run(main)
    run(main)  # a second event loop gets a semaphore (and a client) of its own
    assert sync.count("tenant:a") == 0


def test_retries_wait_and_unbounded_calls(redis_server: RedisServer) -> None:
    sync = Semaphore(redis_server.url, limit=1)

    @bounded("k", 1, redis=redis_server.url, retries=200, retry_delay=0.01)
    async def retrying() -> str:
        return "ran"

    @bounded("k", 1, redis=redis_server.url, on_full="wait", wait_timeout=60)
    async def waiting() -> str:
        return "ran"

    @bounded("k", 1, redis="redis://127.0.0.1:1/0")  # nothing answers there
    async def nowhere() -> str:
        return "ran unbounded"

    async def main() -> None:
        holder = sync.acquire("k", lease=0.5)  # frees itself when its lease lapses
        assert holder is not None
        assert await retrying() == "ran"
        holder = sync.acquire("k")
        assert holder is not None
        call = asyncio.ensure_future(waiting())
        await asyncio.sleep(0.2)
        assert not call.done()
        await asyncio.to_thread(holder.release)  # wakes the waiting call
        assert await asyncio.wait_for(call, 30) == "ran"
        with unbounded():
            assert await nowhere() == "ran unbounded"

    run(main)


def test_a_bounded_coroutine_whose_slot_is_lost_raises(redis_server: RedisServer) -> None:
    sync = Semaphore(redis_server.url, limit=1)
    cancelled: list[bool] = []

    @bounded("k", 1, redis=redis_server.url, lease=2.0, heartbeat=0.1, interrupt=True)
    async def long_call() -> None:
        await asyncio.to_thread(sync.admin.force_release_all, "k")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(SemaphoreLeaseLostError):
        run(long_call)
    assert cancelled == [True]


@pytest.mark.parametrize("on_full", ["queue", "retry"])
def test_a_coroutine_refuses_an_on_full_that_needs_a_task_message(on_full: str) -> None:
    with pytest.raises(SemaphoreValidationError, match=f"on_full='{on_full}' needs a Celery task"):

        @bounded("k", 1, redis="redis://127.0.0.1:1/0", on_full=on_full)
        async def call() -> None: ...
