"""The Celery app that bench_fleet.py runs its workers of: a queueing task, so that every
worker sweeps the waiting rooms, and an unbounded task whose start is timed.

Environment: BENCH_BROKER_URL (the broker, the result backend and the benchmark's own
records), BENCH_SEMAPHORE_URL (the store: the semaphore's keys only). The timings are
written to the broker's Redis, never to the store, so the store's CPU, slow log and
command counts are the library's alone (plus the benchmark's PING and INFO).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_received

from celery_semaphore import SemaphoreTask

BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
STORE = os.environ.get("BENCH_SEMAPHORE_URL", BROKER)

app = Celery("fleet_bench", broker=BROKER, backend=BROKER)
app.conf.update(
    semaphore_url=STORE,
    worker_prefetch_multiplier=1,
    task_acks_late=False,
    task_ignore_result=True,
    # A worker that cannot reach its broker gives up after a bounded wait, not forever.
    broker_connection_timeout=5,
    broker_transport_options={"socket_timeout": 10, "socket_connect_timeout": 5},
)
_records = redis.Redis.from_url(BROKER, socket_timeout=10, socket_connect_timeout=5)


@app.task(base=SemaphoreTask, semaphore="{key}", limit=1, on_full="queue", name="fleet_parked")
def parked(key: str, n: int) -> int:
    """The bounded task whose runs wait in the rooms. Its payloads are built (never sent) by
    bench_fleet.py as the glue builds them; in the steady state no run of it starts."""
    return n


@app.task(name="fleet_unbounded")
def unbounded(sent: float) -> None:
    """A task with no semaphore on the same workers: records its id, when it was sent and
    when its body started (``time.monotonic()``, system-wide on Linux)."""
    from celery import current_task

    _records.rpush("bench:starts", f"{current_task.request.id} {sent} {time.monotonic()}")


@task_received.connect
def _received(request: Any = None, **_: Any) -> None:
    """When the worker's consumer got an unbounded task's message (its main process)."""
    if request is not None and request.name == "fleet_unbounded":
        _records.hset("bench:received", request.id, time.monotonic())
