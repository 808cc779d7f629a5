"""The waiting room with real workers: parked runs start the moment a slot is released."""

from __future__ import annotations

import gc
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.worker import state as worker_state

from celery_semaphore import Semaphore, SemaphoreNotAcquiredError, SemaphoreTask, WaitingRoom
from celery_semaphore.core.handoff import HandoffRoute
from celery_semaphore.core.names import redis_keys
from celery_semaphore.integration.waiting_room.handoffs import publisher_for
from celery_semaphore.integration.waiting_room.queues import SUFFIX
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import (
    AMQP_URL,
    QUEUES,
    delete_queues,
    prefork_worker_process,
    rabbitmq_up,
    spearman,
    wait_for,
)
from .history import BODIES, History


@pytest.fixture
def prefork(app: Celery, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with prefork_worker_process(app, tmp_path / "worker.log") as proc:
        yield proc


def _ran(client: redis.Redis, *expected: str) -> list[int]:
    """Check the history (key "queued" at most 3 in flight; each of the ``expected`` tasks
    ran once, no other task ran) and return each run's ``n``, in the order they started."""
    runs = History.load(client, BODIES)
    runs.assert_ok({"queued": 3}, tasks=expected)
    return runs.values("n")


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_backlog_runs_at_the_limit_in_arrival_order(
    pool: str, app: Celery, client: redis.Redis, request: pytest.FixtureRequest
) -> None:
    task = app.tasks["csem.queued"]
    # Any process of the app can hand a slot over: it publishes the oldest parked run.
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [sem.acquire("queued") for _ in range(3)]  # a full key: every run below parks
    worker = (
        start_worker(app, pool="threads", concurrency=8, perform_ping_check=False)
        if pool == "threads"
        else None
    )
    if worker is None:
        request.getfixturevalue("prefork")
    with worker or _nothing():
        results = []
        for n in range(24):
            results.append(task.delay(n, 0.1))
            # Each run is parked before the next is sent, so arrival order is send order.
            assert wait_for(lambda n=n: len(sem.room.waiters("queued")) == n + 1, timeout=30)
        assert {r.state for r in results} == {"PENDING"}  # parked runs have not run yet
        started = time.monotonic()
        for slot in held:
            assert slot is not None
            slot.release()
        assert [r.get(timeout=60) for r in results] == list(range(24))
        elapsed = time.monotonic() - started
    # Hand-offs go out oldest first; runs handed off together may start a moment apart in
    # either order, so the start order is compared by rank correlation.
    order = _ran(client, *(r.id for r in results))
    assert spearman(order) >= 0.95, order
    assert sem.room.waiters("queued") == []
    assert sem.count("queued") == 0
    # 24 runs of 0.1 s on 3 slots take 0.8 s at best; countdown shedding took several times
    # that. A wide margin: this is a correctness test, the benchmark measures speed.
    assert elapsed < 0.8 * 10, elapsed
    print(f"backlog of 24 x 0.1 s on 3 slots: {elapsed:.2f}s")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_revoked_parked_run_leaves_the_room(app: Celery, client: redis.Redis) -> None:
    task = app.tasks["csem.queued"]
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [sem.acquire("queued") for _ in range(3)]
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        doomed = task.delay(1, 0.0)
        kept = task.delay(2, 0.0)
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 2, timeout=30)
        doomed.revoke()
        # The revoke reaches the worker by broadcast, on a channel of its own: a hand-off
        # published before the worker has it (a loaded machine) would run the run, as
        # Celery runs a task whose revoke comes late. Release once the worker knows.
        assert wait_for(lambda: doomed.id in worker_state.revoked, timeout=30)
        for slot in held:
            assert slot is not None
            slot.release()
        assert kept.get(timeout=60) == 2
        assert wait_for(lambda: doomed.state == "REVOKED", timeout=30)
        assert wait_for(lambda: sem.room.waiters("queued") == [], timeout=30)
        # Seen once in CI: a slot still counted here 30 s on; the holders say whose.
        assert wait_for(lambda: sem.count("queued") == 0, timeout=30), (
            [(h.token, h.metadata, h.expires_in) for h in sem.admin.holders("queued")],
            (doomed.id, kept.id),
        )
    assert _ran(client, kept.id) == [2]


def test_a_sweep_takes_a_revoked_run_out_of_the_room_before_any_slot_frees(
    app: Celery, client: redis.Redis
) -> None:
    # No message of the revoked run reaches a worker (every slot stays held): the worker,
    # knowing the revoke, finds the run's key in its host's journal and takes it out within
    # an interval (2 s), though nothing in the room falls due for 30 s (its next sweep), so
    # no hand-off is ever reserved for it.
    task = app.tasks["csem.queued"]
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [sem.acquire("queued") for _ in range(3)]
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        doomed = task.delay(1, 0.0)
        kept = task.delay(2, 0.0)
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 2, timeout=30)
        revoked_at = time.monotonic()
        doomed.revoke()
        parked = lambda: [w.waiter for w in sem.room.waiters("queued")]  # noqa: E731
        assert wait_for(lambda: parked() == [kept.id], timeout=30), parked()
        assert time.monotonic() - revoked_at < 15  # not at the room's next sweep
        for slot in held:
            slot.release()  # type: ignore[union-attr]
        assert kept.get(timeout=60) == 2
        assert wait_for(lambda: sem.count("queued") == 0, timeout=30)
    assert _ran(client, kept.id) == [2]


def test_the_workers_sweep_drains_a_room_whose_releaser_could_not_publish(
    app: Celery, client: redis.Redis
) -> None:
    # The slots are held, then released, by a process that cannot start a Celery run (as if
    # the releaser had died between its release and the publish): only a worker's sweep can
    # hand the freed slots to the parked runs.
    task = app.tasks["csem.queued"]
    mute = Semaphore(app.conf.semaphore_url, limit=3)
    held = [mute.acquire("queued") for _ in range(3)]
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        results = [task.delay(n, 0.0) for n in range(5)]
        assert wait_for(lambda: len(mute.room.waiters("queued")) == 5, timeout=30)
        for slot in held:
            assert slot is not None
            slot.release()
        assert sorted(r.get(timeout=60) for r in results) == list(range(5))
    _ran(client, *(r.id for r in results))
    assert mute.count("queued") == 0


def test_a_release_hands_off_to_the_hand_off_queue_and_a_sweep_to_the_runs_own_queue(
    app: Celery, client: redis.Redis
) -> None:
    # A sweep is the safety net: a run whose hand-off queue nobody consumes any more (its
    # last worker stopped, or the setting turned off) must still reach a worker.
    task = app.tasks["csem.queued"]
    mute = Semaphore(app.conf.semaphore_url, limit=3)  # leaves freed slots to a sweep
    releaser = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [mute.acquire("queued") for _ in range(2)] + [releaser.acquire("queued")]
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        runs = [task.delay(n, 0.0) for n in range(2)]
        assert wait_for(lambda: len(mute.room.waiters("queued")) == 2, timeout=30)
    # No worker now: each hand-off stays where it was published.
    held[0].release()  # type: ignore[union-attr]
    route = HandoffRoute(30.0, publisher_for(app, False))
    assert WaitingRoom(client, "semaphore", route).sweep("queued") == 1
    assert (client.llen(QUEUES[0]), client.llen(QUEUES[1])) == (1, 0)  # the run's own queue
    held[2].release()  # type: ignore[union-attr]  # a release hands it to the second run
    assert (client.llen(QUEUES[0]), client.llen(QUEUES[1])) == (1, 1)  # the hand-off queue
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert sorted(r.get(timeout=60) for r in runs) == [0, 1]
    held[1].release()  # type: ignore[union-attr]


def test_runs_handed_off_to_a_hand_off_queue_nobody_consumes_reach_a_worker_all_the_same(
    app: Celery, redis_server: RedisServer
) -> None:
    # The last worker with hand-off queues stopped; the one left has them turned off. Its
    # sweeps publish each run to its own queue once the reservation lapses (claim_timeout,
    # the releaser's).
    task = app.tasks["csem.queued"]
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app),
                    claim_timeout=2.0)  # fmt: skip
    held = [sem.acquire("queued") for _ in range(3)]
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        runs = [task.delay(n, 0.0) for n in range(2)]
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 2, timeout=30)
    for slot in held:
        slot.release()  # type: ignore[union-attr]  # to the hand-off queue, unconsumed now
    plain = make_app(redis_server.url, semaphore_handoff_queues=False)
    with start_worker(plain, pool="threads", concurrency=2, perform_ping_check=False):
        assert sorted(r.get(timeout=60) for r in runs) == [0, 1]
    plain.close()


def test_a_run_started_by_a_hand_off_can_retry_itself(app: Celery) -> None:
    # Celery's retry() carries the hand-off header on; the retried run must not take it for a
    # duplicate hand-off (and end quietly, losing the retry).
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [sem.acquire("queued") for _ in range(3)]
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        result = app.tasks["csem.queued_retry"].delay()
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 1, timeout=30)
        held[0].release()  # type: ignore[union-attr]
        assert result.get(timeout=60) == 1
        for slot in held[1:]:
            slot.release()  # type: ignore[union-attr]


def test_a_parked_run_past_its_queue_timeout_fails_and_leaves_the_room(
    app: Celery, client: redis.Redis
) -> None:
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [sem.acquire("queued") for _ in range(3)]
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        impatient = app.tasks["csem.queued_budget"].delay(1)
        patient = app.tasks["csem.queued"].delay(2, 0.0)
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 2, timeout=30)
        # A worker's sweep gives the impatient run up once its 0.5 s budget has passed.
        with pytest.raises(SemaphoreNotAcquiredError, match=r"queue_timeout=0\.5"):
            impatient.get(timeout=60)
        assert [w.waiter for w in sem.room.waiters("queued")] == [patient.id]
        for slot in held:
            assert slot is not None
            slot.release()
        assert patient.get(timeout=60) == 2
    assert _ran(client, patient.id) == [2]  # the impatient body never ran
    assert sem.count("queued") == 0


def test_a_run_that_waits_in_the_worker_starts_on_the_release_without_parking(
    app: Celery, client: redis.Redis
) -> None:
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [sem.acquire("queued") for _ in range(3)]
    blocked = redis_keys("semaphore", "queued").blocked
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        result = app.tasks["csem.waits"].delay(1)
        assert wait_for(lambda: client.zcard(blocked) == 1, timeout=30)
        assert result.state == "PENDING"  # waiting in the worker, not parked
        held[0].release()  # type: ignore[union-attr]
        assert result.get(timeout=60) == 1
        assert sem.room.waiters("queued") == []
        for slot in held[1:]:
            slot.release()  # type: ignore[union-attr]
    assert _ran(client, result.id) == [1]


def test_a_run_whose_wait_timeout_passes_parks_in_arrival_order(
    app: Celery, client: redis.Redis
) -> None:
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [sem.acquire("queued") for _ in range(3)]
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        first = app.tasks["csem.waits_briefly"].delay(1)
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 1, timeout=30)
        second = app.tasks["csem.queued"].delay(2, 0.0)
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 2, timeout=30)
        assert [w.waiter for w in sem.room.waiters("queued")] == [first.id, second.id]
        held[0].release()  # type: ignore[union-attr]
        assert first.get(timeout=60) == 1
        assert second.get(timeout=60) == 2
        for slot in held[1:]:
            slot.release()  # type: ignore[union-attr]
    assert _ran(client, first.id, second.id) == [1, 2]


@pytest.mark.parametrize(
    ("broker", "queues", "handoffs", "backlog", "ahead"),
    [
        # The default: the hand-off goes to the hand-off queue beside the backlog's.
        ("redis", True, None, 0, True),
        # Without hand-off queues, behind the backlog unless at a priority served first
        # (kombu's Redis transport serves a queue's priority lists in the order 0, 3, 6, 9).
        ("redis", False, None, 9, False),
        ("redis", False, 0, 9, True),
        # RabbitMQ serves the highest first, on a queue declared with x-max-priority.
        pytest.param("rabbitmq", True, None, 0, True, marks=pytest.mark.skipif(
            not rabbitmq_up(), reason="no RabbitMQ on 127.0.0.1:5672")),
        pytest.param("rabbitmq", False, 9, 0, True, marks=pytest.mark.skipif(
            not rabbitmq_up(), reason="no RabbitMQ on 127.0.0.1:5672")),
    ],
)  # fmt: skip
def test_a_hand_off_is_fetched_ahead_of_the_backlog(
    broker: str,
    queues: bool,
    handoffs: int | None,
    backlog: int,
    ahead: bool,
    redis_server: RedisServer,
    client: redis.Redis,
) -> None:
    """Three runs park behind a held slot; with the worker stopped, a backlog of 20 more is
    sent; then the slot is released, which publishes the oldest parked run. Sent to the
    hand-off queue (the default), or with ``semaphore_handoff_priority`` above the backlog's,
    the restarted worker fetches that hand-off among its first messages: its run starts
    while most of the backlog is still in the broker. Without either, the hand-off waits
    behind the backlog, all of which parks before the run starts."""
    # No grace: on a slow machine the backlog may take over a second to park, and a run
    # that parks in person past the grace would take the hand-off's slot before it came.
    conf: dict[str, object] = {
        "semaphore_handoff_priority": handoffs,
        "semaphore_handoff_queues": queues,
        "semaphore_handoff_grace": 0,
    }
    if broker == "rabbitmq":
        conf.update(broker_url=AMQP_URL, task_queue_max_priority=10,
                    task_default_queue=f"csem-first-{uuid.uuid4().hex[:8]}")  # fmt: skip
    app = make_app(redis_server.url, **conf)
    sem = Semaphore(redis_server.url, limit=1, on_handoff=publisher_for(app))

    @app.task(base=SemaphoreTask, semaphore="first", limit=1, shared=False, name="first.call")
    def call(n: int) -> int:
        client.rpush("first:parked", len(sem.room.waiters("first")))
        return n

    held = sem.acquire("first")
    assert held is not None
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            parked = [call.apply_async((n,), priority=backlog) for n in range(3)]
            assert wait_for(lambda: len(sem.room.waiters("first")) == 3, timeout=30)
        waiting = [call.apply_async((n,), priority=backlog) for n in range(3, 23)]
        assert held.release()  # the oldest parked run is published now
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            assert parked[0].get(timeout=30) == 0
            for r in parked[1:] + waiting:
                r.get(timeout=60)
        in_room = [int(n) for n in client.lrange("first:parked", 0, -1)]
        print(f"\n{broker}, queues {queues}, priority {handoffs}: parked at each start {in_room}")
        if ahead:
            assert in_room[0] <= 2 + 10, in_room  # two parked before, a few prefetched
        else:
            assert in_room[0] == 22, in_room  # the whole backlog parked first
    finally:
        gc.collect()
        if broker == "rabbitmq":
            default = app.conf.task_default_queue
            delete_queues(app, [default, default + SUFFIX])
        app.close()


def test_a_room_outlives_its_ttl_while_it_is_drained_and_swept(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    # Every run parks within the first moment, and the slots stay held for longer than the
    # room's TTL: only the workers' sweeps touch the room meanwhile. A room whose TTL only a
    # park renews expires with its runs in it.
    app = make_app(redis_server.url, semaphore_room_ttl=5.0)
    task = app.tasks["csem.queued"]
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [sem.acquire("queued") for _ in range(3)]
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        results = [task.delay(n, 0.05) for n in range(6)]
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 6, timeout=30)
        parked_at = time.monotonic()
        keys = redis_keys(sem.prefix, "queued")
        # Wait past a whole TTL with the room untouched by any park, release or claim.
        assert wait_for(lambda: time.monotonic() - parked_at > 7.0, timeout=30)
        assert client.exists(keys.room, keys.parked) == 2, "the room expired while swept"
        for slot in held:
            assert slot is not None
            slot.release()
        assert [r.get(timeout=60) for r in results] == list(range(6))
    assert 0 < client.pttl(keys.parked) <= 5000 or not client.exists(keys.parked)
    gc.collect()
    app.close()


class _SkewedClock:
    """The ``time`` module as a worker whose clock is ``offset`` seconds off sees it."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def time(self) -> float:
        return time.time() + self.offset

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


@pytest.mark.parametrize("offset", [-60.0, 60.0], ids=["behind", "ahead"])
def test_a_parked_runs_budget_is_judged_on_the_stores_clock(
    offset: float, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_semaphore.integration.waiting_room import parking

    app = make_app(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="queued", limit=3, queue_timeout=6.0, shared=False,
              name="csem.skewed_budget")  # fmt: skip
    def skewed_budget() -> None: ...

    sem = Semaphore(app.conf.semaphore_url, limit=3)
    held = [sem.acquire("queued") for _ in range(3)]  # never released: the run must give up
    monkeypatch.setattr(parking, "time", _SkewedClock(offset))
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        sent = time.monotonic()
        result = skewed_budget.delay()
        with pytest.raises(SemaphoreNotAcquiredError):
            result.get(timeout=60)
        waited = time.monotonic() - sent
    # A worker 60 s behind gave up at once; one 60 s ahead waited a minute past its budget.
    # The budget is 6 s, and a sweep gives up a run within about 2 s of it.
    assert 5.0 <= waited <= 30.0, waited
    for slot in held:
        assert slot is not None
        slot.release()
    gc.collect()
    app.close()
