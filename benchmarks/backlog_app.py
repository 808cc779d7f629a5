"""The Celery app that bench_backlog.py drives: one task body, bounded three ways.

Environment: BENCH_BROKER_URL, BENCH_SEMAPHORE_URL, BENCH_LIMIT. Each body records its start
and end (``time.monotonic()``, system-wide on Linux) and its position in the start order in
the semaphore Redis, so the benchmark measures from outside the library.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_semaphore import Rate, SemaphoreTask

BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
STORE = os.environ.get("BENCH_SEMAPHORE_URL", BROKER)
LIMIT = int(os.environ.get("BENCH_LIMIT", "5"))

app = Celery("backlog_bench", broker=BROKER, backend=os.environ.get("BENCH_BACKEND_URL", BROKER))
if "BENCH_QUEUE" in os.environ:  # a shared broker (RabbitMQ) may hold other runs' queues
    app.conf.task_default_queue = os.environ["BENCH_QUEUE"]
app.conf.update(semaphore_url=STORE, worker_prefetch_multiplier=1, task_acks_late=False)
if "BENCH_HANDOFF_GRACE" in os.environ:  # the order-or-fill table of the performance page
    app.conf.semaphore_handoff_grace = float(os.environ["BENCH_HANDOFF_GRACE"])
if "BENCH_HANDOFF_PRIORITY" in os.environ:  # hand-offs ahead of the backlog
    app.conf.semaphore_handoff_priority = int(os.environ["BENCH_HANDOFF_PRIORITY"])
if os.environ.get("BENCH_HANDOFF_QUEUES") == "0":  # hand-offs behind the backlog
    app.conf.semaphore_handoff_queues = False
if os.environ.get("BENCH_JOURNAL") == "0":  # what the host's journal costs a backlog
    app.conf.semaphore_journal = False
_client = redis.Redis.from_url(STORE)


def _body(n: int, seconds: float) -> int:
    start = time.monotonic()
    _client.rpush("bench:order", n)
    time.sleep(seconds)
    _client.rpush("bench:intervals", f"{start} {time.monotonic()}")
    return n


@app.task(base=SemaphoreTask, semaphore="bench", limit=LIMIT, on_full="queue", name="queue")
def queued(n: int, seconds: float) -> int:
    return _body(n, seconds)


@app.task(base=SemaphoreTask, semaphore="bench", limit=LIMIT, on_full="retry", name="retry")
def shed(n: int, seconds: float) -> int:
    return _body(n, seconds)


@app.task(name="unbounded")
def unbounded(n: int, seconds: float) -> int:
    return _body(n, seconds)


@app.task(base=SemaphoreTask, semaphore="noop", limit=10_000, name="noop_bounded")
def noop_bounded(n: int) -> int:
    """A trivial body under a limit it never reaches: bench_overhead.py's bounded task."""
    return n


@app.task(name="noop")
def noop(n: int) -> int:
    """The same body with no semaphore."""
    return n


_trivial = _client.register_script("return 1")


@app.task(name="noop_two_trips")
def noop_two_trips(n: int) -> int:
    """The same body after two EVALSHA of a trivial script on the semaphore's Redis: the two
    round trips a bounded run makes, and nothing else of it (bench_overhead.py's limit)."""
    _trivial(keys=["bench:trivial"], args=[1])
    _trivial(keys=["bench:trivial"], args=[1])
    return n


@app.task(name="noop_one_trip")
def noop_one_trip(n: int) -> int:
    """The same body after one EVALSHA of a trivial script on the semaphore's Redis: the one
    round trip a bounded run must wait for, its acquire (bench_overhead.py's limit, now that
    the release is sent after the run)."""
    _trivial(keys=["bench:trivial"], args=[1])
    return n


def _turn_body(tenant: str, seconds: float) -> str:
    from celery import current_task

    _client.rpush("bench:starts", f"{time.monotonic()} {tenant} {current_task.request.id}")
    time.sleep(seconds)
    return tenant


@app.task(base=SemaphoreTask, semaphore="turns", limit=LIMIT, fair_by="tenant:{tenant}",
          name="fair")  # fmt: skip
def fair(tenant: str, seconds: float) -> str:
    """bench_fairness.py's task: tenants take turns on the shared key."""
    return _turn_body(tenant, seconds)


@app.task(base=SemaphoreTask, semaphore="turns", limit=LIMIT, name="arrival_order")
def arrival_order(tenant: str, seconds: float) -> str:
    """The same task without ``fair_by``: the room keeps arrival order."""
    return _turn_body(tenant, seconds)


def _urgent_b(tenant: str, seconds: float) -> float:
    """Tenant B's runs are urgent: a minute's head start in the room."""
    return 60.0 if tenant == "b" else 0.0


@app.task(base=SemaphoreTask, semaphore="turns", limit=LIMIT, head_start=_urgent_b,
          name="urgent")  # fmt: skip
def urgent(tenant: str, seconds: float) -> str:
    """bench_fairness.py's priority setup: B's runs park with a head start."""
    return _turn_body(tenant, seconds)


@app.task(base=SemaphoreTask, semaphore="turns", limit=LIMIT, fair_by="tenant:{tenant}",
          head_start=_urgent_b, name="fair_urgent")  # fmt: skip
def fair_urgent(tenant: str, seconds: float) -> str:
    """Fair turns and B's head start together."""
    return _turn_body(tenant, seconds)


RATE = os.environ.get("BENCH_RATE", "10/s")


def _rated_body(n: int, seconds: float, tokens: int = 1) -> int:
    from datetime import datetime

    from celery import current_task

    # The instant the store gave the run (a hand-off's eta), or its start when it took a
    # free slot in person.
    eta = current_task.request.eta
    granted = datetime.fromisoformat(eta).timestamp() if eta else time.time()
    _client.rpush("bench:starts", f"{time.time()} {tokens} {granted}")
    time.sleep(seconds)
    return n


@app.task(base=SemaphoreTask, semaphore="rated", limit=20, rate=RATE, name="rated")
def rated(n: int, seconds: float) -> int:
    """bench_rate.py's task: a start rate (BENCH_RATE) beside a limit of 20."""
    return _rated_body(n, seconds)


@app.task(base=SemaphoreTask, semaphore="rated_tokens", limit=20, name="rated_tokens",
          rate=["20/s", Rate("60000/m", name="tokens", burst=300,
                             units=lambda n, seconds, tokens: tokens)])  # fmt: skip
def rated_tokens(n: int, seconds: float, tokens: int) -> int:
    """bench_rate.py's tokens task: 1,000 tokens a second, each run's count its argument, and
    at most 20 runs a second."""
    return _rated_body(n, seconds, tokens)


@app.task(base=SemaphoreTask, semaphore="rated5", limit=5, rate=RATE, on_full="queue",
          name="rated5_queue")  # fmt: skip
def rated5_queue(n: int, seconds: float) -> int:
    """bench_rate.py --modes: the rate with a limit of 5, runs parked in the room."""
    return _rated_body(n, seconds)


@app.task(base=SemaphoreTask, semaphore="rated5w", limit=5, rate=RATE, on_full="wait",
          name="rated5_wait")  # fmt: skip
def rated5_wait(n: int, seconds: float) -> int:
    """bench_rate.py --modes: the same with ``on_full="wait"`` (the room after the wait)."""
    return _rated_body(n, seconds)


@app.task(name="probe")
def probe() -> float:
    """A plain task that answers when its body started (epoch seconds): bench_sweeps.py's
    measure of how long a worker takes to start a message."""
    return time.time()
