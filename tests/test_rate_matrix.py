"""A start rate under every broker kind, every way a run starts, and each control an operator
or a host can change: a pause, a live rate set then cleared, a worker whose clock is off.

Each broker kind has one fleet for the whole module (real worker subprocesses): a worker
with a correct clock, one whose clock is 30 s behind (prefork) and one 30 s ahead (solo),
each consuming its own queue. The clocks are faked by :data:`SKEWED`, a wrapper that offsets
``time.time``, ``time.time_ns`` and ``datetime.now`` before Celery starts: what this host's
clock answers, not Redis's, nor Celery's own code (which reads them). Bodies record their
start by the Redis server's ``TIME``, the one clock every rule is judged by, and the
instant the store granted their slot. Each cell has a key of its own; eager runs have no
broker, so they make one row of cells, run in this process.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_semaphore import Semaphore, SemaphoreTask, current_slot
from celery_semaphore.integration.waiting_room.handoffs import publisher_for
from celery_semaphore.signals import semaphore_shed
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import (
    AMQP_URL,
    ROOT,
    delete_queues,
    rabbitmq_up,
    stop_process,
    wait_for,
    wait_until_ready,
)

LIMIT = 2
CODE_RATE = "10/s"  # one start every 100 ms
LIVE_RATE = "2/s"  # one every 500 ms: set live over the code's, then cleared
SKEW = 30.0  # seconds a skewed worker's clock is off, each way

# The worker subprocess: this host's clock moved by argv[1] seconds (``time.time``, and
# ``datetime.now``, which Celery reads to turn a countdown into an eta), then Celery's worker on
# the module's app for broker kind argv[2] (argv[3]: the store's URL), with argv[4:] as its
# command line.
SKEWED = """
import datetime, sys, time
offset, real, real_ns = float(sys.argv[1]), time.time, time.time_ns
time.time = lambda: real() + offset
time.time_ns = lambda: real_ns() + int(offset * 1e9)
class Skewed(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return super().now(tz) + datetime.timedelta(seconds=offset)
    @classmethod
    def utcnow(cls):
        return super().utcnow() + datetime.timedelta(seconds=offset)
datetime.datetime = Skewed
from tests.test_rate_matrix import matrix_app
matrix_app(sys.argv[2], sys.argv[3]).worker_main(["worker", *sys.argv[4:]])
"""


def matrix_app(kind: str, redis_url: str) -> Celery:
    """The module's app on broker ``kind`` ("redis", "classic", "quorum"), its store (and
    results) on ``redis_url``, with a task per way a run waits, each on one rated key per
    cell ("m:<cell>", limit 2, 10/s): ``m.queue`` parks, ``m.wait`` waits in its worker
    first, ``m.retry`` sheds (a plain acquire each try), ``m.eager`` waits in its caller;
    and ``m.busy``, other work that keeps a pool process busy. Each body records its start
    (the store's TIME), when the store granted its slot (the instant the rate is judged at,
    free of the body's own delay), its ``n`` and its worker's name in "starts:<cell>"."""
    # A default queue (and exchange) of the module's own: RabbitMQ keeps what is declared,
    # and a "celery" exchange left declared as a topic one refuses every other test's.
    conf: dict[str, Any] = {
        "worker_prefetch_multiplier": 1,
        "task_default_queue": f"m-{kind}-default-{uuid.uuid4().hex[:8]}",
    }
    if kind == "quorum":  # Celery's native delayed delivery: quorum queues, topic exchanges
        conf |= {"task_default_queue_type": "quorum", "task_default_exchange_type": "topic",
                 "task_create_missing_queue_type": "quorum",
                 "task_create_missing_queue_exchange_type": "topic"}  # fmt: skip
    app = make_app(redis_url, None if kind == "redis" else AMQP_URL, **conf)
    recorder = redis.Redis.from_url(redis_url)

    def body(task: Any, cell: str, n: int) -> None:
        seconds, micros = recorder.time()
        slot = current_slot()
        assert slot is not None
        start = {"n": n, "at": seconds + micros / 1e6, "granted": slot.acquired_at,
                 "host": task.request.hostname or "eager"}  # fmt: skip
        recorder.rpush(f"starts:{cell}", json.dumps(start))

    options = {"base": SemaphoreTask, "semaphore": "m:{cell}", "limit": LIMIT, "bind": True,
               "rate": CODE_RATE, "shared": False}  # fmt: skip
    for name, extra in [("m.queue", {"on_full": "queue"}),
                        ("m.wait", {"on_full": "wait", "wait_timeout": 0.5}),
                        ("m.retry", {"on_full": "retry", "max_retries": None}),
                        ("m.eager", {"on_full": "wait", "wait_timeout": 30.0})]:  # fmt: skip
        app.task(name=name, **options, **extra)(body)

    @app.task(name="m.busy", shared=False)
    def busy(cell: str, seconds: float) -> None:
        """Keeps a pool process busy (other work, unbounded), once it says it started."""
        recorder.rpush(f"busy:{cell}", 1)
        time.sleep(seconds)

    def shed(sender: Any = None, key: str = "", **_: Any) -> None:
        recorder.rpush(f"refused:{key[2:]}", 1)  # a plain acquire refused: its run was shed

    semaphore_shed.connect(shed, weak=False, dispatch_uid=f"matrix-{kind}-{redis_url}")
    return app


BROKERS = ["redis", "classic", "quorum"]
WAYS = ["handoff", "backlog", "wait", "acquire"]  # and "eager", which has no broker
CONDITIONS = ["pause", "live", "skew"]
ROLES = {"correct": (0.0, "threads", 4), "behind": (-SKEW, "prefork", 2),
         "ahead": (SKEW, "solo", 1)}  # fmt: skip


@dataclass
class Fleet:
    kind: str
    app: Celery
    queues: dict[str, str]  # role -> the queue only that role's worker consumes
    sem: Semaphore
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _start(kind: str, url: str, logs: Path) -> Fleet:
    """Start a fleet's three workers (not waiting for them: see :func:`_ready`)."""
    app = matrix_app(kind, url)
    tag = uuid.uuid4().hex[:6]
    queues = {role: f"m-{kind}-{role}-{tag}" for role in ROLES}
    fleet = Fleet(kind, app, queues, Semaphore(url, limit=LIMIT, on_handoff=publisher_for(app)))
    for role, (offset, pool, concurrency) in ROLES.items():
        name = f"{role}-{tag}@{kind}"
        command = [sys.executable, "-c", SKEWED, str(offset), kind, url, "-P", pool,
                   "-c", str(concurrency), "-Q", queues[role], "-n", name,
                   "--loglevel=INFO", "--without-gossip", "--without-mingle"]  # fmt: skip
        with (logs / f"{kind}-{role}.log").open("wb") as out:
            fleet.procs.append(subprocess.Popen(command, cwd=ROOT, stdout=out,
                                                stderr=subprocess.STDOUT))  # fmt: skip
    return fleet


def _ready(fleet: Fleet, logs: Path) -> None:
    for role, proc in zip(ROLES, fleet.procs, strict=True):
        name = f"{role}-{fleet.queues[role].rsplit('-', 1)[1]}@{fleet.kind}"
        wait_until_ready(fleet.app, proc, name, logs / f"{fleet.kind}-{role}.log", timeout=90)


@pytest.fixture(scope="module")
def store() -> Iterator[RedisServer]:
    """The module's own server (the shared one is flushed before each test: the fleets'
    broker queues would go with it)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def fleets(
    store: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Fleet]]:
    """Every broker kind's fleet, started at once (their start-ups overlap)."""
    logs = tmp_path_factory.mktemp("matrix")
    kinds = BROKERS if rabbitmq_up() else ["redis"]
    started: dict[str, Fleet] = {}
    with ExitStack() as stack:
        stack.callback(lambda: _stop(list(started.values())))
        for kind in kinds:
            started[kind] = _start(kind, store.url, logs)
        for fleet in started.values():
            _ready(fleet, logs)
        yield started


def _stop(fleets: list[Fleet]) -> None:
    procs = [proc for fleet in fleets for proc in fleet.procs]
    for proc in procs:  # every worker shuts down at once, then each is waited for
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        stop_process(proc, timeout=10)
    for fleet in fleets:
        if fleet.kind != "redis":
            queues = [*fleet.queues.values(), fleet.app.conf.task_default_queue]
            handoffs = [f"{queue}.semaphore-handoffs" for queue in queues]
            delete_queues(fleet.app, queues + handoffs, queues)
        fleet.sem.client.close()
        fleet.app.close()


# -- the cells ----------------------------------------------------------------------------


@dataclass
class Cell:
    """One cell's runs, on its own key "m:<name>"."""

    name: str
    fleet: Fleet | None  # None: eager, in this process
    client: redis.Redis
    own: Semaphore
    eager_app: Celery | None = None
    sent: int = 0
    busy: int = 0  # the busy bodies started for it (way "backlog")
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"m:{self.name}"

    def starts(self) -> list[dict[str, Any]]:
        rows = [json.loads(raw) for raw in self.client.lrange(f"starts:{self.name}", 0, -1)]
        return sorted(rows, key=lambda row: row["at"])

    def now(self) -> float:
        seconds, micros = self.client.time()
        return float(seconds + micros / 1e6)

    @property
    def sem(self) -> Semaphore:
        assert self.fleet is not None
        return self.fleet.sem

    @property
    def admin(self) -> Any:
        """The key's admin (pause, live rate): the fleet's, whose resume publishes the runs
        it hands slots to (an admin with no hand-off route leaves them to lapse)."""
        return (self.own if self.fleet is None else self.fleet.sem).admin


def _task(cell: Cell, way: str) -> Any:
    name = {"handoff": "m.queue", "backlog": "m.queue", "wait": "m.wait",
            "acquire": "m.retry", "eager": "m.eager"}[way]  # fmt: skip
    app = cell.eager_app if cell.fleet is None else cell.fleet.app
    assert app is not None
    return app.tasks[name]


def launch(cell: Cell, way: str, count: int, roles: list[str] | None = None) -> float:
    """Send ``count`` runs of the cell that start the way ``way`` says, to the workers of
    ``roles`` in turn (the correct one by default); the store's time from which they may
    start.

    * handoff: every slot is held until the runs are parked, then freed: each run starts by
      claiming the slot a release reserved for it (for its rate instant).
    * backlog: as handoff, but every pool process of the runs' workers is busy with other
      work (0.25 s) when the slots are freed: the hand-offs wait behind it, in the broker or
      the worker's prefetch, and each claim comes after its rate instant.
    * wait: ``on_full="wait"`` runs, a burst, each waiting in its worker for its turn.
    * acquire: ``on_full="retry"`` runs, a burst: each try a plain acquire, shed when the
      rate refuses it (no room ever).
    * eager: ``apply()`` in threads of this process: the call waits for its turn.
    """
    task, first = _task(cell, way), cell.sent
    cell.sent += count
    numbers = range(first, first + count)
    if way == "eager":
        for n in numbers:
            thread = threading.Thread(target=task.apply, args=((cell.name, n),), daemon=True)
            cell.threads.append(thread)
            thread.start()
        return cell.now()
    assert cell.fleet is not None
    queues = [cell.fleet.queues[role] for role in roles or ["correct"]]
    handed = way in ("handoff", "backlog")
    held = [cell.sem.acquire(cell.key) for _ in range(LIMIT)] if handed else []
    for n in numbers:
        task.apply_async((cell.name, n), queue=queues[n % len(queues)])
    if held:
        assert wait_for(lambda: len(cell.sem.room.waiters(cell.key)) == count, timeout=30)
        if way == "backlog":
            for role in roles or ["correct"]:
                queue, processes = cell.fleet.queues[role], ROLES[role][2]
                for _ in range(processes):
                    cell.fleet.app.tasks["m.busy"].apply_async((cell.name, 0.25), queue=queue)
                cell.busy += processes
            assert wait_for(lambda: cell.client.llen(f"busy:{cell.name}") >= cell.busy, 30)
        at = cell.now()
        for slot in held:
            assert slot is not None
            slot.release()
        return at
    return cell.now()


def started(cell: Cell, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The cell's starts once ``count`` have started (failing after ``timeout``)."""
    assert wait_for(lambda: len(cell.starts()) >= count, timeout=timeout), cell.starts()
    return cell.starts()


def _held_back(cell: Cell, way: str, count: int) -> Callable[[], bool]:
    """Whether ``count`` runs of the cell have asked for a slot and been held back, by the
    way they start: parked (a room), or refused and shed (``acquire``), or refused and
    waiting (``eager``)."""
    if way == "eager":  # each call blocks on the key's wake list ("b": blocked right now)
        return lambda: sum(c["cmd"] == "blpop" and "b" in c["flags"]
                           for c in cell.client.client_list()) >= count  # fmt: skip
    if way == "acquire":
        return lambda: cell.client.llen(f"refused:{cell.name}") >= count
    return lambda: (len(cell.sem.room.waiters(cell.key)) + len(cell.starts()) == count
                    and cell.sem.count(cell.key) == 0)  # fmt: skip


def _paused(cell: Cell, way: str) -> None:
    """Nothing starts while the key is paused, however its runs start: not a run parked or
    waiting, nor one already handed its slot (for a rate instant) before the pause; the
    resume starts them all."""
    admin = cell.admin
    if way in ("handoff", "backlog"):  # handed their slots, each for its instant, then paused
        launch(cell, way, 3)
        admin.pause(cell.key)
    else:
        admin.pause(cell.key)
        launch(cell, way, 3)
    assert wait_for(_held_back(cell, way, 3), timeout=20), (cell.starts(), cell.name)
    before = cell.starts()  # only a hand-off claimed before the pause may have started
    assert len(before) <= (1 if way in ("handoff", "backlog") else 0), before
    resumed_at = cell.now()
    admin.resume(cell.key)
    runs = started(cell, 3)
    assert [r for r in runs if r not in before and r["at"] < resumed_at] == [], runs
    assert all(r["at"] - resumed_at < 10 for r in runs), runs  # then they start, promptly


def _gaps(runs: list[dict[str, Any]]) -> list[float]:
    """Seconds between the grants of successive runs, by the store's clock."""
    granted = sorted(r["granted"] for r in runs)
    return [b - a for a, b in itertools.pairwise(granted)]


def _live(cell: Cell, way: str) -> None:
    """A live rate spaces the next starts; a slow one set during an incident and cleared at
    once leaves the next runs to the code's rate, not to its own schedule."""
    cell.admin.set_rate(cell.key, LIVE_RATE)
    launch(cell, way, 3)
    slow = _gaps(started(cell, 3))
    # 2/s: instants 500 ms apart, each run granted within half a spacing of its own, else
    # given a later one (the code's 10/s would grant the three within about 200 ms).
    assert sum(slow) > 2 * 0.5 - 0.25 - 0.01, slow
    assert min(slow) > 0.25 - 0.01, slow
    last = max(r["granted"] for r in cell.starts())
    assert wait_for(lambda: cell.now() > last + 0.5 + 0.01, timeout=5)  # 2/s's next instant
    cell.admin.set_rate(cell.key, "6/m")  # the incident: one run takes the next 10 s...
    launch(cell, way, 1)
    started(cell, 4)
    cell.admin.set_rate(cell.key, None)  # ...and the operator clears it at once
    at = launch(cell, way, 4)
    runs = started(cell, 8)[4:]
    # The cleared 6/m's schedule would start the first of them 10 s after the one before
    # (the code's 10/s: all four within half a second, and a busy machine's hand-offs).
    assert max(r["at"] for r in runs) - at < 7, (at, runs)
    fast = _gaps(runs)
    assert min(fast) > 0.05 - 0.01, fast  # still held to the code's 10/s
    assert sum(fast) > 3 * 0.1 - 0.05 - 0.01, fast


def _skewed(cell: Cell, way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers whose clocks are 30 s behind and ahead send and claim the key's hand-offs
    beside one whose clock is right (eager: the caller's clock is ahead): the starts keep
    the rate by the store's clock, none waits for the skew, and each run runs once."""
    if way == "eager":
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + SKEW)
    at = launch(cell, way, 6, roles=list(ROLES))
    runs = started(cell, 6, timeout=25)
    monkeypatch.undo()
    assert max(r["at"] for r in runs) - at < 10, (at, runs)  # far from 30 s
    gaps = _gaps(runs)
    assert min(gaps) > 0.05 - 0.01, gaps  # 10/s, each within half a spacing of its instant
    assert sum(gaps) > 5 * 0.1 - 0.05 - 0.01, gaps
    if cell.fleet is not None:  # the skewed workers ran runs of their own
        assert {r["host"].split("-")[0] for r in runs} == set(ROLES), runs
    assert wait_for(lambda: cell.own.count(cell.key) == 0, timeout=10)
    assert sorted(r["n"] for r in cell.starts()) == list(range(6)), cell.starts()


# Eager runs have no broker and no worker: one row of cells, in this process, whose clock
# is the one skewed. Every other way is a cell under every broker kind.
CELLS = [pytest.param(kind, way, condition, id=f"{kind}-{way}-{condition}",
                      marks=[] if kind == "redis" else [pytest.mark.skipif(
                          not rabbitmq_up(), reason="no RabbitMQ on 127.0.0.1:5672")])
         for kind in BROKERS for way in WAYS for condition in CONDITIONS] + [
    pytest.param("none", "eager", condition, id=f"eager-{condition}")
    for condition in CONDITIONS]  # fmt: skip


@pytest.fixture(scope="module")
def eager_app(store: RedisServer) -> Iterator[Celery]:
    app = matrix_app("redis", store.url)
    yield app
    app.close()


@pytest.mark.parametrize(("kind", "way", "condition"), CELLS)
def test_a_rate_under_each_broker_way_and_control(
    kind: str, way: str, condition: str, fleets: dict[str, Fleet], eager_app: Celery,
    store: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    client = store.client()
    own = Semaphore(client, limit=LIMIT)
    cell = Cell(f"{kind}-{way}-{condition}", fleets.get(kind), client, own, eager_app)
    try:
        if condition == "pause":
            _paused(cell, way)
        elif condition == "live":
            _live(cell, way)
        else:
            _skewed(cell, way, monkeypatch)
    finally:
        for thread in cell.threads:
            thread.join(timeout=30)
        client.close()


@pytest.mark.parametrize("role", ["behind", "ahead"])
def test_a_worker_whose_clock_is_off_starts_rate_hand_offs_on_the_stores_time(
    role: str, fleets: dict[str, Fleet], store: RedisServer, request: pytest.FixtureRequest
) -> None:
    """Hand-offs for instants more than a second away carry an eta, which Celery holds by
    the clock of the worker that fetches it. A worker 30 s behind (publishing its runs' next
    hand-offs as it releases, and fetching them) held each for 30 s more; one 30 s ahead
    fetched them at once, and only the claim kept them from starting early. Each is now
    held until its instant by the store's clock, and the rate's spacing holds."""
    fleet, client = fleets["redis"], store.client()
    request.addfinalizer(client.close)
    cell = Cell(f"clock-{role}", fleet, client, Semaphore(client, limit=LIMIT))
    cell.admin.set_rate(cell.key, "1/s")  # instants a second apart: beyond the eta threshold
    at = launch(cell, "handoff", 3, roles=[role])  # the third's hand-off carries an eta
    runs = started(cell, 3, timeout=25)
    assert max(r["at"] for r in runs) - at < 2 + 5, (at, runs)  # 2 s of spacing, not 30 s
    assert min(_gaps(runs)) > 0.5 - 0.01, runs
    assert {r["host"].split("-")[0] for r in runs} == {role}, runs
    assert wait_for(lambda: cell.own.count(cell.key) == 0, timeout=10)
    assert sorted(r["n"] for r in cell.starts()) == [0, 1, 2], cell.starts()
