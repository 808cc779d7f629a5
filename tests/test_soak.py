"""Soak: many bounded tasks over prefork and threads workers, with killed pool processes and
a frozen semaphore store; nothing over the limit, nothing lost, nothing left held.

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

from .celery_apps import interval_key, make_app
from .helpers import peak_overlap, read_intervals, wait_for

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
    app = make_app(redis_server.url, semaphore_url=own_redis.url)
    client = redis.Redis.from_url(redis_server.url)
    env = {**os.environ, "CSEM_TEST_REDIS_URL": redis_server.url,
           "CSEM_TEST_SEMAPHORE_URL": own_redis.url}  # fmt: skip
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
            # Faults at fixed times, while tasks are still running: three pool processes
            # SIGKILLed, and the slots' Redis frozen for longer than a lease.
            plan = [(1.5, "kill"), (3.0, "kill"), (4.5, "pause"), (6.0, "kill")]
            deadline = time.monotonic() + 600
            while sum(1 for r in results if r.ready()) < soak_tasks:
                assert time.monotonic() < deadline, "the soak did not finish in 10 minutes"
                if plan and time.monotonic() - started >= plan[0][0]:
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
                time.sleep(0.1)
            states = Counter(r.state for r in results)
            assert not plan, f"the tasks finished before every fault was injected: {plan}, {states}"
            states = Counter(r.state for r in results)
            del results
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(timeout=60)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
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
    # Failures are the runs whose process was killed or whose slot was lost in the freeze.
    assert states["SUCCESS"] >= soak_tasks - 3 - 3 * LIMIT, states
