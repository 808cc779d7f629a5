"""Provider feedback with real workers: a run whose provider answers 429 backs off, the key
cools down for the whole fleet, the run keeps its place and its ``max_retries``, and an
adaptive limit is cut. On a real redis-server and in-process workers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from prometheus_client import CollectorRegistry

from celery_semaphore import (
    Adaptive,
    BackOff,
    Refusal,
    Semaphore,
    SemaphoreNotAcquiredError,
    SemaphoreTask,
    bounded,
)
from celery_semaphore.core.replies import Parked
from celery_semaphore.core.slot import Slot
from celery_semaphore.integration.remote import waiting_by_key
from celery_semaphore.integration.waiting_room.keeper import JournalKeeper
from celery_semaphore.signals import semaphore_backed_off, semaphore_shed
from celery_semaphore.testing import RedisServer
from celery_semaphore.views.metrics import RoomCollector

from .celery_apps import make_app
from .helpers import Published, cli


class TooManyRequests(Exception):
    """What a provider client raises on a 429, with the hint where httpx's error has it."""

    def __init__(self, retry_after: str) -> None:
        super().__init__("429")
        self.response = type("Response", (), {"headers": {"Retry-After": retry_after}})()


def _store_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


def test_a_429_cools_the_key_down_and_the_run_keeps_its_place_and_its_retries(
    app: Celery, client: redis.Redis, registry: CollectorRegistry
) -> None:
    """The first run's provider answers 429 with Retry-After: 2. No run starts anywhere
    until the cool-down ends (another process's acquire is refused too); then the run that
    backed off is among the first handed a slot, ahead of the runs that came after it, with
    retries still 0."""
    log = "feedback:starts"

    @app.task(base=SemaphoreTask, semaphore="provider", limit=Adaptive(4, max=8),
              back_off_on=(TooManyRequests,), bind=True, max_retries=0, shared=False,
              name="feedback.call")  # fmt: skip
    def call(self: Any, n: int) -> dict[str, Any]:
        client.rpush(log, f"{n} {_store_now(client)}")
        if n == 0 and client.set("feedback:refused-once", 1, nx=True):
            raise TooManyRequests("2")
        time.sleep(0.3)
        headers = self.request.headers or {}
        return {"retries": self.request.retries, "back_offs": headers.get("semaphore_back_offs")}

    backed: list[dict[str, Any]] = []
    semaphore_backed_off.connect(lambda **kw: backed.append(kw), weak=False)
    other = Semaphore(app.conf.semaphore_url, limit=4)
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
            first = call.delay(0)
            assert wait_until(lambda: backed)
            later = [call.delay(n) for n in range(1, 6)]
            assert other.acquire("provider") is None  # every caller: slots free, none given
            results = [r.get(timeout=60) for r in [first, *later]]
    finally:
        semaphore_backed_off.receivers.clear()
    assert results[0] == {"retries": 0, "back_offs": 1}
    cooling_until = backed[0]["cooling_until"]
    assert backed[0]["retry_after"] == 2.0
    assert backed[0]["key"] == "provider"
    starts = [line.decode().split() for line in client.lrange(log, 0, -1)]
    after = [(int(n), float(at)) for n, at in starts[1:]]
    assert all(at >= cooling_until - 0.05 for _, at in after), (cooling_until, starts)
    # The run that backed off kept its place: it is among the first two (the limit, cut
    # from 4) that the room hands out together once the cool-down ends.
    assert 0 in {n for n, _ in after[:2]}, starts
    feedback = other.admin.feedback("provider")
    assert feedback is not None
    assert feedback.back_offs == 1
    assert feedback.limit is not None
    assert (feedback.min, feedback.max) == (1, 8)
    assert registry.get_sample_value("semaphore_back_offs_total", {"key": "provider"}) == 1


def wait_until(predicate: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_run_that_backs_off_past_max_back_offs_fails_naming_the_key_and_the_count(
    app: Celery,
) -> None:
    @app.task(base=SemaphoreTask, semaphore="stubborn", limit=2, max_back_offs=2,
              shared=False, name="feedback.stubborn")  # fmt: skip
    def stubborn() -> None:
        raise BackOff(0.05)

    with (
        start_worker(app, pool="threads", concurrency=2, perform_ping_check=False),
        pytest.raises(SemaphoreNotAcquiredError) as failed,
    ):
        stubborn.delay().get(timeout=60)
    assert failed.value.reason == Refusal.BACK_OFF
    assert "'stubborn'" in str(failed.value)
    assert "backed off 3 times" in str(failed.value)


def test_on_full_retry_sheds_for_the_cool_down_and_raise_fails_with_reason_backoff(
    app: Celery, client: redis.Redis
) -> None:
    @app.task(base=SemaphoreTask, semaphore="shedding", limit=2, on_full="retry", bind=True,
              max_retries=0, shared=False, name="feedback.shedding")  # fmt: skip
    def shedding(self: Any) -> int:
        if client.set("feedback:shed-once", 1, nx=True):
            raise BackOff(retry_after=1.0)
        return int(self.request.retries)

    @app.task(base=SemaphoreTask, semaphore="raising", limit=2, on_full="raise",
              shared=False, name="feedback.raising")  # fmt: skip
    def raising() -> None:
        raise BackOff()

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        sent = time.monotonic()
        assert shedding.delay().get(timeout=60) == 0
        assert time.monotonic() - sent >= 0.9
        with pytest.raises(SemaphoreNotAcquiredError) as failed:
            raising.delay().get(timeout=60)
    assert failed.value.reason == Refusal.BACK_OFF


def test_an_eager_run_waits_out_its_cool_down_and_runs_again(
    app: Celery, client: redis.Redis
) -> None:
    app.conf.task_always_eager = True

    @app.task(shared=False, name="feedback.legacy")
    @bounded("legacy-api", Adaptive(2, max=4), back_off_on=TooManyRequests)
    def legacy(n: int) -> int:
        if client.set("feedback:eager-once", 1, nx=True):
            raise TooManyRequests("1")
        return n

    started = time.monotonic()
    assert legacy.delay(7).get(timeout=30) == 7
    assert time.monotonic() - started >= 0.9
    assert Semaphore(app.conf.semaphore_url, limit=1).admin.feedback("legacy-api") is not None


def test_an_adaptive_limit_can_be_declared_in_app_conf_semaphores(app: Celery) -> None:
    app.conf.semaphores = {"declared": {"limit": Adaptive(3, max=6), "max_back_offs": 1}}

    @app.task(base=SemaphoreTask, semaphore="declared", shared=False, name="feedback.declared")
    def declared() -> None:
        raise BackOff(0.01)

    with (
        start_worker(app, pool="threads", concurrency=1, perform_ping_check=False),
        pytest.raises(SemaphoreNotAcquiredError, match="backed off 2 times"),
    ):
        declared.delay().get(timeout=60)
    feedback = Semaphore(app.conf.semaphore_url, limit=1).admin.feedback("declared")
    assert feedback is not None
    assert (feedback.min, feedback.max) == (1, 6)


def test_every_view_shows_the_adaptive_limit_and_the_cool_down(
    app: Celery, client: redis.Redis
) -> None:
    """status (text and JSON), why, the inspection views and Prometheus show the adaptive
    limit with its bounds, the cool-down's end and the last back-off."""
    sem = Semaphore(app.conf.semaphore_url, limit=Adaptive(4, min=2, max=6),
                    on_handoff=Published())  # fmt: skip
    held = sem.room.park("k", "w0", b"p")
    assert isinstance(held, Slot)
    held.back_off(30)
    assert isinstance(sem.room.park("k", "w1", b"p"), Parked)  # slots free, none given
    status = cli(app, "status", "k")
    assert "adaptive limit 2 (from 2 to 6)" in status, status
    assert "COOLING until" in status, status
    assert "1 back-off(s), the last by" in status, status
    assert "(hint 30s)" in status, status
    [found] = json.loads(cli(app, "status", "k", "--json"))
    assert found["limit"] == 2
    assert found["feedback"]["back_offs"] == 1
    assert found["feedback"]["max"] == 6
    assert "COOLING until" in cli(app, "why", "w1")
    inspected = waiting_by_key(app, ["k"])["k"]  # what `celery inspect semaphores` shows
    assert inspected["feedback"]["back_offs"] == 1
    assert inspected["feedback"]["limit"] == 2
    rooms = CollectorRegistry()
    rooms.register(RoomCollector(client))
    assert rooms.get_sample_value("semaphore_limit_current", {"key": "k"}) == 2
    cooling = rooms.get_sample_value("semaphore_cooling_until_seconds", {"key": "k"})
    assert cooling is not None
    assert cooling > time.time() + 20


def test_a_restart_of_the_store_that_loses_the_adaptive_limit_says_so(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Proves: the adaptive limit and a cool-down lost with the store fall back to the
    limit's initial, and the worker says so in an ERROR line naming the key."""
    with RedisServer() as store:
        app = make_app(redis_server.url, semaphore_url=store.url)

        @app.task(base=SemaphoreTask, semaphore="lossy", limit=Adaptive(5, max=9),
                  shared=False, name="feedback.lossy")  # fmt: skip
        def lossy() -> None: ...

        sem = Semaphore(store.url, limit=Adaptive(5, max=9))
        slot = sem.acquire("lossy")
        assert slot is not None
        slot.back_off(60)
        keeper = JournalKeeper(app)
        keeper.keep()
        store.stop()
        store.start()
        caplog.set_level(logging.ERROR)
        keeper.keep()
        assert sem.admin.feedback("lossy") is None  # nothing cools it, the limit is 5 again
        assert len([sem.acquire("lossy") for _ in range(5)]) == 5
        lines = [r.getMessage() for r in caplog.records if "adaptive limit" in r.getMessage()]
        assert lines == ["semaphore 'lossy': a restart of the store lost its adaptive limit "
                         "and any cool-down; the limit starts again from 5"]  # fmt: skip
        sem.client.close()
        app.close()


def test_a_back_off_while_the_store_is_down_sheds_the_run_and_it_runs_later(
    redis_server: RedisServer,
) -> None:
    """Proves: a body that backs off while the store is away is not lost: its slot lapses,
    the run is shed (its message published again through the broker, which is up), and it
    runs once the store is back."""
    with RedisServer() as store:
        app = make_app(redis_server.url, semaphore_url=store.url)
        recorder = redis_server.client()

        @app.task(base=SemaphoreTask, semaphore="flaky", limit=2, bind=True, max_retries=0,
                  shared=False, name="feedback.flaky")  # fmt: skip
        def flaky(self: Any) -> int:
            if recorder.set("feedback:started", 1, nx=True):
                assert recorder.blpop(["feedback:store-down"], timeout=30)
                raise BackOff(0.1)
            return int(self.request.retries)

        shed: list[dict[str, Any]] = []
        semaphore_shed.connect(lambda **kw: shed.append(kw), weak=False)
        try:
            with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
                result = flaky.delay()
                assert wait_until(lambda: recorder.exists("feedback:started"))
                store.stop()
                recorder.rpush("feedback:store-down", 1)
                # Shed (the store's clients gave up), or failed: only then is it back.
                assert wait_until(lambda: shed or result.ready())
                store.start()
                assert result.get(timeout=60) == 0
        finally:
            semaphore_shed.receivers.clear()
        assert "Redis unreachable" in shed[0]["reason"]
        app.close()


def test_a_bounded_coroutine_backs_off_on_its_back_off_on(redis_server: RedisServer) -> None:
    """An ``async def`` under ``@bounded`` backs its key off on one of ``back_off_on``, with
    the adaptive limit it declares, and lets the back-off out (as a plain call does)."""
    app = make_app(redis_server.url)

    @bounded("async-api", Adaptive(4, max=8), app=app, back_off_on=TooManyRequests)
    async def fetch() -> None:
        raise TooManyRequests("7")

    with pytest.raises(BackOff) as backed:
        asyncio.run(fetch())
    assert isinstance(backed.value.__cause__, TooManyRequests)  # the provider's error, kept
    feedback = Semaphore(redis_server.url, limit=1).admin.feedback("async-api")
    assert feedback is not None
    assert (feedback.last_hint, feedback.limit, feedback.max) == (7.0, 2, 8)
    app.close()
