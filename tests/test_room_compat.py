"""The waiting room (``on_full="queue"``) wherever a Celery user would use it: a RabbitMQ
broker, Sentinel and Cluster stores, the prefork, threads and solo pools, canvas (group,
chord, chain, link), eager mode, direct calls and ``apply()`` (outside a worker and inside
a worker's run), and ``AsyncResult`` while a run is parked.

Every task here passes ``on_full="queue"`` explicitly. The bounded runs record themselves
(arguments, whether a hand-off started them) in the tests' history (tests/history.py) with a
client of their own (``csem.room_step`` in tests/celery_apps.py), so peaks and run counts are
measured outside the library. The backlogs are parked one by one behind slots the test
holds, so their arrival order is their send order; the test then releases the slots through
a semaphore that publishes hand-offs as the app's workers do.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult

from celery_semaphore import Semaphore, SemaphoreTask, Slot
from celery_semaphore.integration.waiting_room.handoffs import publisher_for
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import AMQP_URL, prefork_worker_process, rabbitmq_up, wait_for
from .history import BODIES, History, Run
from .servers import ClusterServers, SentinelServers

LIMIT = 2
"""``csem.room_step``'s limit."""
ROOM_SUFFIXES = ("", ":room", ":parked")
"""The Redis keys of one semaphore key with parked runs are ``semaphore:{<key>}`` and these
suffixes (no ``:holders`` hash: each holder's record is in its member)."""


# --- helpers -------------------------------------------------------------------------------


def _redis_names(key: str) -> list[str]:
    """The Redis keys of semaphore key ``key`` under the default prefix."""
    return [f"semaphore:{{{key}}}{suffix}" for suffix in ROOM_SUFFIXES]


def _runs(client: redis.Redis, key: str, tasks: list[str] | None = None) -> list[Run]:
    """The runs of ``csem.room_step`` on ``room:<key>``, in the order they started, once the
    history is checked: at most LIMIT in flight, each task run once (exactly ``tasks``, if
    named)."""
    runs = History.load(client, BODIES)
    runs.assert_ok({f"room:{key}": LIMIT}, tasks=tasks)
    return runs.runs


class Holding:
    """Every slot of ``room:<key>``, held by a semaphore of ``app`` that publishes the
    hand-offs its releases make, as the app's workers do."""

    def __init__(self, app: Celery, store: str, key: str, limit: int = LIMIT) -> None:
        self.key = f"room:{key}"
        self.sem = Semaphore(store, limit=limit, on_handoff=publisher_for(app))
        self.held: list[Slot] = []
        for _ in range(limit):
            slot = self.sem.acquire(self.key)
            assert slot is not None
            self.held.append(slot)

    def parked(self) -> int:
        return len(self.sem.room.waiters(self.key))

    def release(self) -> None:
        while self.held:
            assert self.held.pop(0).release()

    def close(self) -> None:
        self.release()
        self.sem.client.close()


@contextmanager
def holding(app: Celery, store: str, key: str, limit: int = LIMIT) -> Iterator[Holding]:
    held = Holding(app, store, key, limit)
    try:
        yield held
    finally:
        held.close()


def _park_backlog(
    app: Celery, holder: Holding, key: str, count: int, duration: float
) -> list[AsyncResult]:
    """Send ``count`` runs of ``csem.room_step`` on ``room:<key>`` (values 0, 1, ...), each
    once the one before is parked: their arrival order is their send order."""
    task = app.tasks["csem.room_step"]
    results = []
    for n in range(count):
        results.append(task.delay(n, 0, key, duration))
        assert wait_for(lambda n=n: holder.parked() == n + 1, timeout=30), n
    # A parked run has not run yet: its state stays PENDING.
    assert {r.state for r in results} == {"PENDING"}
    return results


def _drain(
    holder: Holding,
    results: list[AsyncResult],
    client: redis.Redis,
    key: str,
    side_by_side: bool = True,
) -> None:
    """Release the held slots; the parked backlog must drain at the limit, in arrival order,
    each run exactly once, every result back through ``AsyncResult.get()``."""
    holder.release()
    count = len(results)
    assert [r.get(timeout=60) for r in results] == list(range(count))
    runs = _runs(client, key, tasks=[r.id for r in results])
    assert all(run.data["handoff"] for run in runs), "a parked run started without a hand-off"
    # The room hands slots out oldest first, and at most LIMIT runs hold or wait for a slot
    # at once, so a run can only start before the (at most LIMIT - 1) older runs handed a
    # slot at about the same time.
    order = [run.data["value"] for run in runs]
    assert all(abs(position - value) < LIMIT for position, value in enumerate(order)), order
    if side_by_side:
        assert History(runs).peak() == LIMIT, "the backlog never ran at the limit"
    assert holder.sem.room.waiters(holder.key) == []
    assert wait_for(lambda: holder.sem.count(holder.key) == 0, timeout=30)


GREEN = ("gevent", "eventlet")
"""The green-thread pools, whose workers the tests run as subprocesses (each patches the
standard library as it starts)."""


def _missed(client: redis.Redis) -> int:
    """Hand-offs the test's workers fetched that found nothing to claim (read once they have
    stopped: a worker writes the counts it holds as it stops)."""
    return sum(int(client.hget(key, "handoffs_missed") or 0)
               for key in client.scan_iter(match="semaphore:stats:*"))  # fmt: skip


WATCH = 0.5
"""Seconds a test watches a call that must still be waiting (a run that must not start, a
result that must not be ready). Only a bug ends such a wait early, so a slow machine can
make the check weaker but never makes it fail."""


def _worker(
    app: Celery, pool: str, log: Path, env: dict[str, str] | None = None
) -> AbstractContextManager[object]:
    """A worker of ``app`` with ``pool``: prefork, gevent and eventlet as a ``celery worker``
    subprocess (``env`` added to its environment), threads and solo in this process."""
    if pool in GREEN:
        return prefork_worker_process(app, log, concurrency=8, env=env, pool=pool)
    if pool == "prefork":
        return prefork_worker_process(app, log, concurrency=4, env=env)
    if pool == "threads":
        return start_worker(app, pool="threads", concurrency=4, perform_ping_check=False)
    return start_worker(app, pool="solo", perform_ping_check=False)


# --- 1. a RabbitMQ broker --------------------------------------------------------------------


def _delete_queue(app: Celery, queue: str) -> None:
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        channel.queue_delete(queue)
        channel.exchange_delete(queue)


@pytest.mark.skipif(not rabbitmq_up(), reason="no RabbitMQ on 127.0.0.1:5672")
@pytest.mark.parametrize("pool", ["threads", "prefork", *GREEN])
def test_a_backlog_drains_through_a_rabbitmq_broker(
    pool: str, redis_server: RedisServer, client: redis.Redis, tmp_path: Path
) -> None:
    # With prefork, each hand-off is published to RabbitMQ from a pool child.
    queue = f"csem-room-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server.url, broker_url=AMQP_URL, task_default_queue=queue)
    env = {"CSEM_TEST_BROKER_URL": AMQP_URL, "CSEM_TEST_DEFAULT_QUEUE": queue}
    try:
        with (
            holding(app, redis_server.url, "rabbit") as holder,
            _worker(app, pool, tmp_path / "worker.log", env),
        ):
            results = _park_backlog(app, holder, "rabbit", 8, 0.2)
            _drain(holder, results, client, "rabbit")
        if pool in GREEN:  # each parked run started by one hand-off, none wasted
            assert _missed(client) == 0
    finally:
        _delete_queue(app, queue)
        app.close()


# --- 2. Sentinel and Redis Cluster stores ----------------------------------------------------


def _assert_room_keys_share_the_hash_tag(cluster: ClusterServers, key: str) -> None:
    """The three Redis keys of ``key`` (slots, room, parked) exist and, by the
    server's own CLUSTER KEYSLOT, they and any other key of it sit in the slot of the key's
    hash tag."""
    names = set(_redis_names(key))
    client = cluster.client()
    node = cluster.nodes[0].client()
    try:
        found = {name.decode() for name in client.scan_iter(match=f"semaphore:{{{key}}}*")}
        assert names <= found, found
        slots = {node.execute_command("CLUSTER KEYSLOT", name) for name in found}
        assert slots == {node.execute_command("CLUSTER KEYSLOT", key)}
    finally:
        node.close()
        client.close()


@pytest.mark.parametrize("store", ["cluster", "sentinel_set"])
def test_a_backlog_drains_on_a_cluster_or_sentinel_store(
    store: str, request: pytest.FixtureRequest, redis_server: RedisServer, client: redis.Redis
) -> None:
    servers: ClusterServers | SentinelServers = request.getfixturevalue(store)
    if isinstance(servers, ClusterServers):
        admin: Any = servers.client()
        admin.flushall()  # every primary
    else:
        admin = servers.master_client()
        admin.flushall()
    admin.close()
    app = make_app(redis_server.url, semaphore_url=servers.url)
    key = store.replace("_", "-")
    with (
        holding(app, servers.url, key) as holder,
        start_worker(app, pool="threads", concurrency=6, perform_ping_check=False),
    ):
        results = _park_backlog(app, holder, key, 6, 0.2)
        if isinstance(servers, ClusterServers):
            _assert_room_keys_share_the_hash_tag(servers, f"room:{key}")
        else:
            primary = servers.primary().client()
            assert primary.exists(*_redis_names(f"room:{key}")) == 3
            primary.close()
        _drain(holder, results, client, key)
    app.close()


# --- 3. pools --------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo", *GREEN])
def test_a_backlog_drains_in_each_pool(
    pool: str, app: Celery, client: redis.Redis, tmp_path: Path
) -> None:
    # With solo, the one process that runs a holder also publishes the hand-off its release
    # makes, and takes that message only after the holder's run has ended. The long
    # claim_timeout of csem.room_step (60 s) means that a hand-off nobody published would
    # not be rescued by a sweep before the results' timeouts: every run is started by one.
    with (
        holding(app, app.conf.semaphore_url, pool) as holder,
        _worker(app, pool, tmp_path / "worker.log"),
    ):
        results = _park_backlog(app, holder, pool, 8, 0.2)
        _drain(holder, results, client, pool, side_by_side=pool != "solo")
    if pool in GREEN:  # each parked run started by one hand-off, none wasted
        assert _missed(client) == 0


# --- 4. canvas -------------------------------------------------------------------------------


def test_groups_chords_chains_and_links_of_parked_runs_complete(
    app: Celery, client: redis.Redis
) -> None:
    step = app.tasks["csem.room_step"]
    collect = app.tasks["csem.room_collect"]
    key = "canvas"
    with (
        holding(app, app.conf.semaphore_url, key) as holder,
        start_worker(app, pool="threads", concurrency=8, perform_ping_check=False),
    ):
        chained = chain(
            step.s(1000, 1, key, 0.05),
            step.s(step=2, key=key, duration=0.05),
            step.s(step=3, key=key, duration=0.05),
            step.s(step=4, key=key, duration=0.05),
        ).delay()
        # The chain's first link parks first, so it is served first; the links after it
        # arrive while the group and the chord's header (8 runs of 0.2 s) hold the slots.
        assert wait_for(lambda: holder.parked() == 1, timeout=30)
        grouped = group(step.s(n, 0, key, 0.2) for n in range(4)).delay()
        header = (step.s(n, 100, key, 0.2) for n in range(10, 14))
        chorded = chord(header, collect.s(key)).delay()
        linked = step.apply_async((2000, 0, key, 0.05), link=collect.si([2000], f"{key}-link"))
        # Every run that can start (4 of the group, 4 of the chord's header, the chain's
        # first link, the run with a link callback) finds the key full and parks.
        assert wait_for(lambda: holder.parked() == 10, timeout=30)
        assert {r.state for r in grouped.results} == {"PENDING"}
        holder.release()
        assert chorded.get(timeout=60) == [110, 111, 112, 113]
        assert chained.get(timeout=60) == 1010
        assert grouped.get(timeout=60) == [0, 1, 2, 3]
        assert linked.get(timeout=60) == 2000
        assert wait_for(
            lambda: History.load(client, BODIES).of(f"collect:{key}-link").runs, timeout=30
        )
    # Each bounded run ran exactly once, at most LIMIT at a time; each callback ran once.
    seen = History.load(client, BODIES)
    seen.assert_ok({holder.key: LIMIT, f"collect:{key}": 1, f"collect:{key}-link": 1})
    runs = seen.of(holder.key).runs
    expected = [(n, 0) for n in range(4)] + [(n, 100) for n in range(10, 14)]
    expected += [(1000, 1), (1001, 2), (1003, 3), (1006, 4), (2000, 0)]
    assert sorted((run.data["value"], run.data["step"]) for run in runs) == sorted(expected)
    # The chord's callback fired once, with every result of its header; the link's, once.
    [callback] = seen.of(f"collect:{key}").runs
    assert sorted(callback.data["values"]) == [110, 111, 112, 113]
    assert len(seen.of(f"collect:{key}-link").runs) == 1
    # Each link of the chain ran after the one before it ended, on that one's result.
    links = sorted(
        (r for r in runs if 1000 <= r.data["value"] < 2000), key=lambda r: r.data["step"]
    )
    assert [link.data["step"] for link in links] == [1, 2, 3, 4]
    assert all(
        earlier.end is not None and later.start >= earlier.end
        for earlier, later in itertools.pairwise(links)
    )
    # The second link was parked too, and its hand-off carried the rest of the chain on.
    assert links[1].data["handoff"], links
    assert holder.sem.room.waiters(holder.key) == []


# --- 5. eager mode, direct calls, apply() ----------------------------------------------------


CALLS: dict[str, Callable[[Any, str], Any]] = {
    "eager": lambda task, key: task.delay(5, 1, key, 0.0).get(),
    "direct": lambda task, key: task(5, 1, key, 0.0),
    "apply": lambda task, key: task.apply((5, 1, key, 0.0)).get(),
}


@pytest.mark.parametrize("mode", sorted(CALLS))
def test_outside_a_worker_a_full_key_is_waited_for_and_never_parks(
    mode: str, redis_server: RedisServer, client: redis.Redis
) -> None:
    app = make_app(redis_server.url, task_always_eager=mode == "eager")
    task = app.tasks["csem.room_step"]
    key = f"outside-{mode}"
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = CALLS[mode](task, key)
        except BaseException as exc:
            outcome["error"] = exc

    with holding(app, redis_server.url, key) as holder:
        caller = threading.Thread(target=call)
        caller.start()
        try:
            caller.join(timeout=WATCH)
            assert caller.is_alive(), outcome  # it waits for a slot
            assert History.load(client, BODIES).runs == []  # the body has not run
            assert holder.parked() == 0
            holder.held.pop().release()
            caller.join(timeout=60)
        finally:
            holder.release()
            caller.join(timeout=60)
    assert outcome == {"value": 6}
    [run] = _runs(client, key)
    assert not run.data["handoff"]
    # Nothing was ever parked: the room's keys were never made.
    assert client.exists(*_redis_names(holder.key)[1:]) == 0
    app.close()


@pytest.mark.parametrize("mode", ["direct", "apply"])
def test_inside_a_workers_run_a_direct_call_or_apply_waits_too(
    mode: str, app: Celery, client: redis.Redis
) -> None:
    # A task body that calls a queueing task directly (or through apply()) runs it in its
    # own run: it waits for a slot there, and never parks.
    step = app.tasks["csem.room_step"]
    key = f"inside-{mode}"

    @app.task(shared=False, name="csem.room_outer")
    def outer() -> int:
        client.set(f"test:room:{key}:outer", 1)
        if mode == "direct":
            return int(step(5, 1, key, 0.0))
        return int(step.apply((5, 1, key, 0.0)).get())

    with (
        holding(app, app.conf.semaphore_url, key) as holder,
        start_worker(app, pool="threads", concurrency=2, perform_ping_check=False),
    ):
        result = outer.delay()
        assert wait_for(lambda: client.exists(f"test:room:{key}:outer"), timeout=30)
        assert not wait_for(result.ready, timeout=WATCH)  # the call in it waits for a slot
        assert result.state == "PENDING"
        assert History.load(client, BODIES).runs == []
        assert holder.parked() == 0
        holder.held.pop().release()
        assert result.get(timeout=60) == 6
    [run] = _runs(client, key)
    assert not run.data["handoff"]
    assert client.exists(*_redis_names(holder.key)[1:]) == 0


# --- 6. AsyncResult while parked -------------------------------------------------------------


@pytest.mark.parametrize(
    "store", ["backend-redis", "other-redis", "other-redis-app-ignores-results"]
)
def test_a_parked_run_is_pending_and_get_returns_once_it_runs(
    store: str, request: pytest.FixtureRequest, redis_server: RedisServer
) -> None:
    # The semaphore on the result backend's Redis, or on another; with the app ignoring
    # results, the task's own ignore_result=False must win for its parked runs too.
    other = store != "backend-redis"
    url = request.getfixturevalue("own_redis").url if other else redis_server.url
    conf = {"task_ignore_result": True} if store.endswith("ignores-results") else {}
    app = make_app(redis_server.url, semaphore_url=url, **conf)

    @app.task(base=SemaphoreTask, semaphore="room:result", limit=1, on_full="queue",
              ignore_result=False, shared=False, name="csem.room_result")  # fmt: skip
    def room_result(n: int) -> dict[str, int]:
        return {"n": n}

    outcome: dict[str, Any] = {}
    with (
        holding(app, url, "result", limit=1) as holder,
        start_worker(app, pool="threads", concurrency=4, perform_ping_check=False),
    ):
        result = room_result.delay(7)
        assert wait_for(lambda: holder.parked() == 1, timeout=30)
        assert result.state == "PENDING"
        if other:
            # The room is in the semaphore's store; the backend holds only the result.
            backend = redis.Redis.from_url(redis_server.url)
            assert backend.exists(*_redis_names(holder.key)) == 0
            backend.close()
        assert holder.sem.client.exists(*_redis_names(holder.key)[1:]) == 2

        def get() -> None:
            try:
                outcome["value"] = result.get(timeout=60)
            except BaseException as exc:
                outcome["error"] = exc

        getter = threading.Thread(target=get)
        getter.start()
        getter.join(timeout=WATCH)
        assert getter.is_alive(), outcome  # a parked run is not ready
        holder.release()
        getter.join(timeout=90)
        assert not getter.is_alive()
        assert outcome == {"value": {"n": 7}}
        assert result.state == "SUCCESS"
    app.close()
