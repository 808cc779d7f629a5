"""Faults: the semaphore under a frozen, restarted or unreachable Redis, and killed bodies."""

from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Semaphore, SemaphoreError, SemaphoreLeaseLostError
from celery_semaphore.testing import RedisServer

from . import history
from .celery_apps import make_app
from .helpers import prefork_worker_process, run_in_threads, wait_for
from .history import BODIES, History

ROOT = Path(__file__).resolve().parent.parent


def test_rapid_cycles_with_short_leases_report_no_spurious_loss(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sem = Semaphore(redis_server.url, limit=3, lease=0.2)
    errors: list[BaseException] = []
    cycles = itertools.count()

    def cycle() -> None:
        for _ in range(250):
            try:
                with (
                    sem.hold("rapid", retries=1000, retry_delay=0.001) as slot,
                    history.run(client, BODIES, "rapid", task_id=f"{next(cycles)}", slot=slot),
                ):
                    pass
            except BaseException as exc:
                errors.append(exc)

    run_in_threads(cycle, 4)
    assert errors == []
    History.load(client, BODIES).assert_ok({"rapid": 3}, tasks=[f"{n}" for n in range(1000)])
    assert sem.count("rapid") == 0


def test_after_a_pause_longer_than_the_lease_the_limit_holds_again(
    own_redis: RedisServer, client: redis.Redis
) -> None:
    limit, lease = 2, 1.0
    sem = Semaphore(own_redis.client(socket_timeout=None), limit=limit, lease=lease)
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            try:
                with (
                    sem.hold("paused", retries=50, retry_delay=0.02) as slot,
                    history.run(client, BODIES, "paused", task_id=uuid.uuid4().hex, slot=slot),
                ):
                    slot.lost.wait(random.uniform(0.02, 0.1))
            except SemaphoreError:
                continue

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for t in threads:
        t.start()
    try:
        assert wait_for(lambda: len(History.load(client, BODIES).runs) > 20, timeout=30)
        own_redis.pause()
        time.sleep(2.5 * lease)  # the fault itself: Redis frozen for longer than a lease
        own_redis.resume()
        resumed = time.monotonic()
        assert wait_for(
            lambda: sum(r.start > resumed for r in History.load(client, BODIES).runs) > 20,
            timeout=60,
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    # Bodies that kept their slot never overlapped beyond the limit, before or after.
    History.load(client, BODIES).assert_ok(
        {"paused": limit}, may_lose="the store froze for 2.5 leases"
    )


def test_a_restart_without_persistence_is_a_loss_for_every_holder(
    own_redis: RedisServer, client: redis.Redis
) -> None:
    sem = Semaphore(own_redis.url, limit=3, lease=3.0)
    outcomes: list[str] = []
    holding = threading.Barrier(4)

    def holder(n: int) -> None:
        try:
            with (
                sem.hold("restarted", heartbeat=0.2) as slot,
                history.run(client, BODIES, "restarted", task_id=f"{n}", slot=slot),
            ):
                holding.wait()
                slot.lost.wait(30)
            outcomes.append("kept")
        except SemaphoreLeaseLostError:
            outcomes.append("lost")

    threads = [threading.Thread(target=holder, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    holding.wait()
    own_redis.restart()
    for t in threads:
        t.join(timeout=60)
    assert outcomes == ["lost"] * 3
    holders = ["0", "1", "2"]
    History.load(client, BODIES).assert_ok({"restarted": 3}, tasks=holders, lost=holders)
    # The empty server admits new holders, and counts them right (scripts reload by themselves).
    slots = [sem.acquire("restarted") for _ in range(4)]
    assert [s is not None for s in slots] == [True, True, True, False]
    assert sem.count("restarted") == 3


def test_a_task_is_shed_while_redis_is_unreachable_and_runs_once_it_is_back(
    redis_server: RedisServer, own_redis: RedisServer, client: redis.Redis
) -> None:
    # The broker stays up; only the semaphore's Redis goes away.
    app = make_app(redis_server.url, semaphore_url=own_redis.url)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        own_redis.stop()
        result = app.tasks["csem.provider_call"].delay(1, 0)
        assert wait_for(lambda: result.state == "RETRY", timeout=60)
        own_redis.start()
        value = result.get(timeout=60)
    assert value["n"] == 1
    assert value["sheds"] >= 1
    History.load(client, BODIES).assert_ok({"provider": 3}, tasks=[result.id])


@pytest.fixture
def prefork(redis_server: RedisServer, tmp_path: Path) -> Iterator[Celery]:
    app = make_app(redis_server.url)
    with prefork_worker_process(app, tmp_path / "worker.log", concurrency=2):
        yield app


def test_a_hard_time_limit_frees_the_slot_at_once(prefork: Celery, client: redis.Redis) -> None:
    from celery.exceptions import TimeLimitExceeded

    result = prefork.tasks["csem.sleepy"].apply_async((120,), time_limit=3)
    assert wait_for(lambda: History.load(client, BODIES).runs, timeout=60)
    sem = Semaphore(prefork.conf.semaphore_url, limit=1)
    assert sem.count("sleepy") == 1
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=60)
    # The lease is 30 s: only the worker's main process can have freed it this soon.
    assert wait_for(lambda: sem.count("sleepy") == 0, timeout=15)
    # The pool ends the body at the limit (its SIGTERM raises in it), not 120 s later.
    runs = History.load(client, BODIES)
    runs.assert_ok({"sleepy": 1}, tasks=[result.id])
    assert all((r.end or 0) - r.start < 10 for r in runs.runs), runs


def test_revoke_with_terminate_frees_the_slot(prefork: Celery, client: redis.Redis) -> None:
    result = prefork.tasks["csem.sleepy"].delay(120)
    assert wait_for(lambda: History.load(client, BODIES).runs, timeout=60)
    sem = Semaphore(prefork.conf.semaphore_url, limit=1)
    assert sem.count("sleepy") == 1
    result.revoke(terminate=True, signal="SIGKILL")
    assert wait_for(lambda: sem.count("sleepy") == 0, timeout=15)
    assert wait_for(lambda: result.state == "REVOKED", timeout=30)
    History.load(client, BODIES).assert_ok({"sleepy": 1}, tasks=[], killed=[result.id])


def test_an_evicting_redis_is_warned_about_when_a_worker_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with RedisServer(extra_args=("--maxmemory-policy", "allkeys-lru")) as server:
        app = make_app(server.url)
        with (
            caplog.at_level("WARNING", logger="celery_semaphore"),
            start_worker(app, pool="solo", perform_ping_check=False),
        ):
            pass
    assert any("allkeys-lru" in r.getMessage() for r in caplog.records), caplog.text


def test_a_noeviction_redis_gets_no_warning(redis_server: RedisServer) -> None:
    from celery_semaphore.core.admin import SemaphoreAdmin

    assert SemaphoreAdmin(redis_server.client()).server_warnings() == []
