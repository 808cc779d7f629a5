"""Soak: many bounded tasks over prefork and threads workers, with killed pool processes and
a frozen semaphore store; nothing over the limit, nothing lost, nothing left held.

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
from pathlib import Path

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Semaphore
from celery_semaphore.testing import RedisServer

from .celery_apps import AT_LEAST_ONCE, interval_key, make_app
from .helpers import peak_overlap, read_intervals, stop_process, wait_for

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 4
LEASE = 2.0


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


@pytest.mark.soak
def test_soak(
    redis_server: RedisServer, own_redis: RedisServer, tmp_path: Path, soak_tasks: int
) -> None:
    # The broker and the bodies' records live on one server, the slots on another, which
    # the test freezes.
    app = make_app(redis_server.url, semaphore_url=own_redis.url, **AT_LEAST_ONCE)
    client = redis.Redis.from_url(redis_server.url)
    env = {**os.environ, "CSEM_TEST_REDIS_URL": redis_server.url,
           "CSEM_TEST_SEMAPHORE_URL": own_redis.url, "CSEM_TEST_ACKS_LATE": "1"}  # fmt: skip
    workers = []
    for i in range(2):
        log = (tmp_path / f"prefork-{i}.log").open("wb")
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.celery_apps", "worker", "-P", "prefork",
             "-c", "3", "-n", f"soak-{i}-{uuid.uuid4().hex[:6]}@%h", "--without-gossip",
             "--without-mingle", "--loglevel=WARNING"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
    rng = random.Random(1234)
    faults: Counter[str] = Counter()
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
            assert wait_for(lambda: len(app.control.ping(timeout=0.5)) >= 3, timeout=90)
            task = app.tasks["csem.soak"]
            started = time.monotonic()
            results = [task.delay(n, rng.uniform(0, 0.03)) for n in range(soak_tasks)]
            # Faults at fixed points of progress (bodies recorded), so each lands while tasks
            # still run: three pool processes SIGKILLed, and the slots' Redis frozen for longer
            # than a lease.
            plan = [(0.1, "kill"), (0.25, "kill"), (0.4, "pause"), (0.6, "kill")]
            deadline = time.monotonic() + 240
            while plan:
                assert time.monotonic() < deadline, f"stuck before the faults: {plan}"
                if client.llen(interval_key("soak")) >= plan[0][0] * soak_tasks:
                    _, fault = plan.pop(0)
                    if fault == "kill":
                        pool = [p for w in workers for p in _children(w.pid)]
                        os.kill(rng.choice(pool), signal.SIGKILL)
                        faults["pool process SIGKILLed"] += 1
                    else:
                        own_redis.pause()
                        time.sleep(1.5 * LEASE)  # the fault: frozen for longer than a lease
                        own_redis.resume()
                        faults["semaphore Redis frozen for 1.5 leases"] += 1
                time.sleep(0.02)
            while not all(r.ready() for r in results):
                assert time.monotonic() < deadline, (
                    f"the soak did not finish in 4 minutes: {Counter(r.state for r in results)}"
                )
                time.sleep(0.2)
            states = Counter(r.state for r in results)
            del results
    finally:
        for w in workers:
            stop_process(w, timeout=60)
    elapsed = time.monotonic() - started
    intervals = read_intervals(client, interval_key("soak"))
    peak = peak_overlap(intervals)
    sem = Semaphore(own_redis.url, limit=LIMIT)
    assert wait_for(lambda: sem.count("soak") == 0, timeout=2 * LEASE + 10)
    print(
        f"\nsoak: {soak_tasks} tasks in {elapsed:.1f}s over 2 prefork (3 each) + 1 threads (4)"
        f" workers, limit {LIMIT}; faults: {dict(faults)}; final states: {dict(states)};"
        f" peak in flight (slot kept): {peak}; tasks lost: {soak_tasks - sum(states.values())};"
        f" slots leaked: {sem.count('soak')}"
    )
    assert peak <= LIMIT
    assert set(states) <= {"SUCCESS", "FAILURE"}, states
    # Failures are the runs whose slot was lost in the freeze (killed runs are requeued).
    assert states["SUCCESS"] >= soak_tasks - 3 * LIMIT, states
