"""Why a run got no slot: each reason a user can provoke, on the error, in the
``semaphore_refused`` signal, in the metrics and in the log line, against real servers and a
real worker."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import pickle
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from prometheus_client import CollectorRegistry

from celery_semaphore import (
    Refusal,
    Semaphore,
    SemaphoreNotAcquiredError,
    SemaphoreTask,
    bounded,
)
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.signals import semaphore_refused
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import wait_for


def test_the_error_keeps_its_reason_through_pickle_and_celerys_json() -> None:
    error = SemaphoreNotAcquiredError("no room", "k", 3, Refusal.ROOM_FULL)
    again = pickle.loads(pickle.dumps(error))
    assert (again.reason, again.key, again.limit, str(again)) == (Refusal.ROOM_FULL, "k", 3,
                                                                  "no room")  # fmt: skip
    # Celery stores an exception's args and calls the class with them again.
    rebuilt = SemaphoreNotAcquiredError(*json.loads(json.dumps(error.args)))
    assert rebuilt.reason is Refusal.ROOM_FULL
    assert rebuilt.reason == "room_full"
    assert SemaphoreNotAcquiredError("m").reason is Refusal.FULL
    with pytest.raises(ValueError, match="sleepy"):
        SemaphoreNotAcquiredError("m", "k", 1, "sleepy")


def test_a_hold_that_only_tried_is_full_and_one_that_waited_timed_out(
    redis_server: RedisServer,
) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    held = sem.acquire("k")
    assert held is not None
    with pytest.raises(SemaphoreNotAcquiredError) as full, sem.hold("k", retries=2):
        pass
    assert full.value.reason is Refusal.FULL
    with pytest.raises(SemaphoreNotAcquiredError) as waited, sem.hold("k", wait=0.2):
        pass
    assert waited.value.reason is Refusal.TIMEOUT
    with pytest.raises(SemaphoreNotAcquiredError) as several, sem.hold_many([("k", 1), ("o", 1)]):
        pass
    assert several.value.reason is Refusal.FULL
    held.release()


def test_an_asyncio_wait_ended_by_aclose_is_a_shutdown(redis_server: RedisServer) -> None:
    async def main() -> None:
        sem = AsyncSemaphore(redis_server.url, limit=1)
        held = Semaphore(redis_server.url, limit=1).acquire("k")  # not the semaphore closed
        assert held is not None

        async def wait_long() -> None:
            async with sem.hold("k", wait=60.0):
                pass

        waiter = asyncio.ensure_future(wait_long())
        blocked = redis_server.client()
        for _ in range(600):  # registered as blocked: it is in its wait now
            if blocked.zcard("semaphore:{k}:blocked"):
                break
            await asyncio.sleep(0.05)
        assert blocked.zcard("semaphore:{k}:blocked") == 1
        started = time.monotonic()
        await sem.aclose()
        with pytest.raises(SemaphoreNotAcquiredError) as closed:
            await waiter
        assert closed.value.reason is Refusal.SHUTDOWN
        assert time.monotonic() - started < 30  # not the 60 s it would have waited
        # The semaphore is usable again, and a wait that runs out is a timeout, not a close.
        with pytest.raises(SemaphoreNotAcquiredError) as timed_out:
            async with sem.hold("k", wait=0.2):
                pass
        assert timed_out.value.reason is Refusal.TIMEOUT
        await sem.aclose()
        held.release()
        blocked.close()

    asyncio.run(main())


@pytest.fixture
def refusals() -> Iterator[list[dict[str, Any]]]:
    """Every ``semaphore_refused`` this process sends during the test."""
    seen: list[dict[str, Any]] = []

    def on_refused(sender: Any = None, **fields: Any) -> None:
        seen.append(fields)

    semaphore_refused.connect(on_refused, weak=False)
    yield seen
    semaphore_refused.disconnect(on_refused)


def _refused_count(registry: CollectorRegistry, key: str, reason: str) -> float:
    found = registry.get_sample_value("semaphore_refused_total", {"key": key, "reason": reason})
    return 0.0 if found is None else found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _fails_with(result: Any) -> SemaphoreNotAcquiredError:
    with pytest.raises(SemaphoreNotAcquiredError) as failed:
        result.get(timeout=60)
    return failed.value


@pytest.fixture
def reasons_app(redis_server: RedisServer) -> Iterator[Celery]:
    app = make_app(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="r-raise", limit=1, on_full="raise",
              shared=False, name="r.raise")  # fmt: skip
    def at_once() -> None: ...

    @app.task(base=SemaphoreTask, semaphore="r-room", limit=1, max_queued=1,
              shared=False, name="r.room")  # fmt: skip
    def room() -> None: ...

    @app.task(base=SemaphoreTask, semaphore="r-park", limit=1, queue_timeout=1.0,
              shared=False, name="r.park")  # fmt: skip
    def park() -> None: ...

    @app.task(base=SemaphoreTask, semaphore="r-shed", limit=1, on_full="retry",
              shed_max_retries=2, shared=False, name="r.shed")  # fmt: skip
    def shed() -> None: ...

    yield app
    gc.collect()
    app.close()


def test_each_reason_a_worker_gives_is_on_the_error_the_signal_the_metric_and_the_log(
    reasons_app: Celery,
    redis_server: RedisServer,
    registry: CollectorRegistry,
    refusals: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = reasons_app
    sem = Semaphore(redis_server.url, limit=1)
    holders = [sem.acquire(key) for key in ("r-raise", "r-room", "r-park", "r-shed")]
    assert all(holders)
    expected = {"r.raise": Refusal.FULL, "r.park": Refusal.TIMEOUT, "r.shed": Refusal.FULL}
    with (
        caplog.at_level(logging.INFO, logger="celery_semaphore"),
        start_worker(app, pool="threads", concurrency=4, perform_ping_check=False),
    ):
        results = {name: app.tasks[name].delay() for name in expected}
        parked = app.tasks["r.room"].delay()
        assert wait_for(lambda: redis_server.client().zcard("semaphore:{r-room}:room") == 1)
        over = app.tasks["r.room"].delay()
        errors = {name: _fails_with(result) for name, result in results.items()}
        errors["r.room"] = _fails_with(over)
        holders[1].release()  # type: ignore[union-attr]
        parked.get(timeout=60)
    expected["r.room"] = Refusal.ROOM_FULL
    assert {name: error.reason for name, error in errors.items()} == expected
    # Celery stored the error as JSON and built it again: the waiting client sees the reason.
    assert errors["r.park"].key == "r-park"
    by_key = {fields["key"]: fields for fields in refusals}
    for name, reason in expected.items():
        key = name.replace("r.", "r-")
        assert by_key[key]["reason"] is reason, by_key[key]
        assert by_key[key]["message"] == errors[name].message
        assert _refused_count(registry, key, reason.value) == 1
        assert any(f"semaphore {key!r} (limit 1): refused ({reason.value}): " in r.getMessage()
                   for r in caplog.records), key  # fmt: skip
    for holder in holders:
        holder.release()  # type: ignore[union-attr]


def test_a_store_out_of_reach_until_the_budget_is_spent_fails_closed_as_backend(
    redis_server: RedisServer, refusals: list[dict[str, Any]]
) -> None:
    dead = f"redis://127.0.0.1:{_free_port()}/0"
    app = make_app(redis_server.url, semaphore_url=dead)

    @app.task(base=SemaphoreTask, semaphore="r-down", limit=1, shed_max_retries=1,
              shared=False, name="r.down")  # fmt: skip
    def down() -> None: ...

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        error = _fails_with(down.delay())
    assert error.reason is Refusal.BACKEND
    assert [f["reason"] for f in refusals if f["key"] == "r-down"] == [Refusal.BACKEND]
    gc.collect()
    app.close()


def test_outside_a_worker_the_wait_is_a_timeout_and_a_plain_call_is_full(
    redis_server: RedisServer, refusals: list[dict[str, Any]]
) -> None:
    app = make_app(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="r-eager", limit=1, queue_timeout=0.2,
              shared=False, name="r.eager")  # fmt: skip
    def eager() -> None: ...

    @bounded("r-plain", 1, app=app)
    def plain() -> None: ...

    sem = Semaphore(redis_server.url, limit=1)
    holders = [sem.acquire("r-eager"), sem.acquire("r-plain")]
    with pytest.raises(SemaphoreNotAcquiredError) as waited:
        eager.apply().get()
    assert waited.value.reason is Refusal.TIMEOUT
    with pytest.raises(SemaphoreNotAcquiredError) as tried:
        plain()
    assert tried.value.reason is Refusal.FULL
    assert [f["reason"] for f in refusals] == [Refusal.TIMEOUT, Refusal.FULL]
    for holder in holders:
        holder.release()  # type: ignore[union-attr]
    gc.collect()
    app.close()
