"""Soak: many bounded tasks over prefork and threads workers, with killed pool processes and
a frozen semaphore store; nothing over the limit, nothing lost, nothing left held.

Two phases, each on fresh workers: shedding (``on_full="retry"``: runs that find the key
full are published again with a countdown), and a backlog in the waiting room
(``on_full="queue"``: every task sent at once, parked and handed slots as others release).

The app uses Celery's at-least-once settings (acks_late, reject_on_worker_lost), so a task
whose pool process is SIGKILLed runs again instead of failing.

Runs in CI at a modest size; ``pytest -m soak --soak-tasks 5000`` makes it bigger.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Semaphore
from celery_semaphore.testing import RedisServer

from .celery_apps import AT_LEAST_ONCE, add_room_fault_tasks, make_app
from .helpers import child_pids, stop_process, unacked_task_ids, wait_for
from .history import BODIES, History, history_key

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 4
LEASE = 2.0
FAULTS = [(0.1, "kill"), (0.25, "kill"), (0.4, "pause"), (0.6, "kill")]
"""Faults at fixed points of progress (bodies recorded), so each lands while tasks still
run: three pool processes SIGKILLed, and the slots' Redis frozen for longer than a lease."""
FREEZE = "the semaphore's Redis froze for 1.5 leases"
"""Why a run may report its slot lost."""


def _progress(client: redis.Redis) -> float:
    """About how many bodies have run: each records its start and its end."""
    return client.llen(history_key(BODIES)) / 2


class RunsLost(AssertionError):
    """Runs that the at-least-once settings promise to finish never did."""


def _children(pid: int) -> list[int]:
    return child_pids(pid)


@contextmanager
def _soak_workers(
    redis_server: RedisServer, own_redis: RedisServer, tmp_path: Path, on_full: str
) -> Iterator[tuple[Celery, list[subprocess.Popen[bytes]]]]:
    """Two prefork workers (3 processes each) and one threads worker (4 threads), all
    answering ping when the block starts. The broker and the bodies' records live on one
    server, the slots on another (``own_redis``), which the test freezes. ``on_full`` is the
    app's default; tasks that name their own keep it."""
    app = add_room_fault_tasks(
        make_app(
            redis_server.url,
            semaphore_url=own_redis.url,
            semaphore_on_full=on_full,
            **AT_LEAST_ONCE,
        )
    )
    env = {**os.environ, "CSEM_TEST_REDIS_URL": redis_server.url,
           "CSEM_TEST_SEMAPHORE_URL": own_redis.url, "CSEM_TEST_ACKS_LATE": "1",
           "CSEM_TEST_ON_FULL": on_full, "CSEM_TEST_RECORD_DELIVERIES": "1"}  # fmt: skip
    workers = []
    for i in range(2):
        log = (tmp_path / f"prefork-{i}.log").open("wb")
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.celery_apps", "worker", "-P", "prefork",
             "-c", "3", "-n", f"soak-{i}-{uuid.uuid4().hex[:6]}@%h", "--without-gossip",
             "--without-mingle", "--loglevel=WARNING"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
            assert wait_for(lambda: len(app.control.ping(timeout=0.5)) >= 3, timeout=90)
            yield app, workers
    finally:
        for w in workers:
            stop_process(w, timeout=60)
        app.close()


def _inject(
    fault: str,
    rng: random.Random,
    own_redis: RedisServer,
    pool: Callable[[], list[int]],
    faults: Counter[str],
    killed: list[int],
) -> None:
    """SIGKILL one of ``pool()`` (waiting up to 30 s for one; its pid goes to ``killed``), or
    freeze ``own_redis`` for 1.5 leases."""
    if fault == "kill":
        found: list[int] = []

        def any_found() -> bool:
            found[:] = pool()
            return bool(found)

        assert wait_for(any_found, timeout=30), "no pool process to kill"
        victim = rng.choice(found)
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)
        faults["pool process SIGKILLed"] += 1
    else:
        own_redis.pause()
        time.sleep(1.5 * LEASE)  # the fault: frozen for longer than a lease
        own_redis.resume()
        faults["semaphore Redis frozen for 1.5 leases"] += 1


@pytest.mark.soak
def test_soak(
    redis_server: RedisServer, own_redis: RedisServer, tmp_path: Path, soak_tasks: int
) -> None:
    """Shedding (``on_full="retry"``): peak <= limit; every task's body ran to its end once
    (twice only for the task a killed process was running: killed after its body ended, or
    after its shed published the run again and before its own delivery was acknowledged;
    at-least-once delivery runs it again, as it would after Celery's own ``retry()``), a
    body that never ended was in a killed process; no slot leaked."""
    client = redis.Redis.from_url(redis_server.url)
    rng = random.Random(1234)
    faults: Counter[str] = Counter()
    killed: list[int] = []
    with _soak_workers(redis_server, own_redis, tmp_path, "retry") as (app, workers):
        task = app.tasks["csem.soak"]
        started = time.monotonic()
        results = [task.delay(n, rng.uniform(0, 0.03)) for n in range(soak_tasks)]
        plan = list(FAULTS)
        deadline = time.monotonic() + 240
        while plan:
            assert time.monotonic() < deadline, f"stuck before the faults: {plan}"
            if _progress(client) >= plan[0][0] * soak_tasks:
                _, fault = plan.pop(0)
                pool = lambda: [p for w in workers for p in _children(w.pid)]  # noqa: E731
                _inject(fault, rng, own_redis, pool, faults, killed)
            time.sleep(0.02)
        while not all(r.ready() for r in results):
            assert time.monotonic() < deadline, (
                f"the soak did not finish in 4 minutes: {Counter(r.state for r in results)}"
            )
            time.sleep(0.2)
        states = Counter(r.state for r in results)
        ids = [r.id for r in results]
        del results
    elapsed = time.monotonic() - started
    # Killed runs are run again (at least once): a body killed mid-run never ended, and the
    # task a killed process was running (its body, or its shed) may have run twice.
    report = History.load(client, BODIES).check(
        {"soak": LIMIT}, tasks=ids, killed_pids=killed, may_lose=FREEZE
    )
    sem = Semaphore(own_redis.url, limit=LIMIT)
    assert wait_for(lambda: sem.count("soak") == 0, timeout=2 * LEASE + 10)
    print(
        f"\nsoak: {soak_tasks} tasks in {elapsed:.1f}s over 2 prefork (3 each) + 1 threads (4)"
        f" workers, limit {LIMIT}; faults: {dict(faults)}; final states: {dict(states)};"
        f" {report.summary()}; slots leaked: {sem.count('soak')}"
    )
    assert report.ok, report
    assert set(states) <= {"SUCCESS", "FAILURE"}, states
    # Failures are the runs whose slot was lost in the freeze (killed runs are requeued).
    assert states["SUCCESS"] >= soak_tasks - 3 * LIMIT, states


def _quiet(client: redis.Redis, sem: Semaphore, key: str) -> bool:
    """Nothing can start another run of ``key``: no message queued or out for delivery
    (with acks_late a running or held-back task's message is out), nothing parked, no slot
    held or reserved."""
    return (
        client.llen("celery") == 0
        and unacked_task_ids(client) == []
        and sem.admin.room(key) == []
        and sem.count(key) == 0
    )


@pytest.mark.soak
def test_soak_backlog_in_the_waiting_room(
    redis_server: RedisServer, own_redis: RedisServer, tmp_path: Path, soak_tasks: int
) -> None:
    """The waiting room (``on_full="queue"``) under a backlog, with the same faults: half as
    many tasks, all sent at once, so nearly every run parks and is started by a hand-off.
    Each kill lands mid-body: the process is one whose pid a slot holder recorded. Proves
    peak <= limit; no body finished twice (a delivery beyond the first, after a lapsed or
    re-handed reservation, ends without running it), but for a run killed after its body
    ended and before its task returned, which at-least-once runs again; no task lost (a
    killed run is requeued and finishes); no slot leaked and nothing left parked."""
    count = max(soak_tasks // 2, 100)
    key = "soak-queue"
    client = redis.Redis.from_url(redis_server.url)
    sem = Semaphore(own_redis.url, limit=LIMIT)
    rng = random.Random(4321)
    faults: Counter[str] = Counter()
    killed: list[int] = []
    with _soak_workers(redis_server, own_redis, tmp_path, "queue") as (app, workers):
        task = app.tasks["csem.soak_queued"]

        def running_in_pool() -> list[int]:
            """Pool processes running a body now (they hold a slot of the key)."""
            pool = {p for w in workers for p in _children(w.pid)}
            try:
                pids = {h.metadata.get("pid") for h in sem.holders(key)}
            except Exception:  # the store is frozen or just back: try again
                return []
            return sorted(pool & pids)  # type: ignore[arg-type]

        started = time.monotonic()
        results = [task.delay(n, rng.uniform(0, 0.03)) for n in range(count)]
        plan = list(FAULTS)
        deadline = time.monotonic() + 240
        while plan:
            assert time.monotonic() < deadline, f"stuck before the faults: {plan}"
            if _progress(client) >= plan[0][0] * count:
                _inject(plan.pop(0)[1], rng, own_redis, running_in_pool, faults, killed)
            time.sleep(0.02)
        # Done when every task is, or when nothing is left that could start one (then the
        # unfinished ones are lost); checked twice, a second apart.
        while not all(r.ready() for r in results):
            assert time.monotonic() < deadline, (
                f"the backlog did not finish in 4 minutes: {Counter(r.state for r in results)}"
            )
            if _quiet(client, sem, key):
                time.sleep(1.0)
                if _quiet(client, sem, key):
                    break
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        states = Counter(r.state for r in results)
        ids = [r.id for r in results]
        unfinished = [r.id for r in results if not r.ready()]
        del results
    # A body that ended in a process then killed before its task returned runs again (at
    # least once): the last body each killed process ended may end twice; no other may.
    report = History.load(client, BODIES).check(
        {key: LIMIT}, tasks=ids, killed_pids=killed, may_lose=FREEZE
    )
    assert wait_for(lambda: sem.count(key) == 0, timeout=2 * LEASE + 10)
    print(
        f"\nsoak backlog (waiting room): {count} tasks in {elapsed:.1f}s, limit {LIMIT};"
        f" faults: {dict(faults)}; final states: {dict(states)}; {report.summary()};"
        f" tasks unfinished: {len(unfinished)}; slots leaked: {sem.count(key)}; parked left:"
        f" {len(sem.admin.room(key))}"
    )
    assert faults["pool process SIGKILLed"] == 3
    assert report.ok, report
    assert sem.admin.room(key) == []
    if unfinished:
        raise RunsLost(f"{len(unfinished)} task(s) never finished: {states}; {unfinished}")
    assert set(states) <= {"SUCCESS", "FAILURE"}, states
    # Failures are the runs whose slot was lost in the freeze (killed runs are requeued).
    assert states["SUCCESS"] >= count - 3 * LIMIT, states
