"""Priority in the waiting room, on a real Redis: a run parked with a head start stands that
many seconds before its arrival, so it passes the runs that came less than that long before
it and never an older one; with fair turns it moves within its turns, never before the
room's head; and a bad head start is refused before anything is written."""

from __future__ import annotations

import math

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Semaphore, SemaphoreTask, SemaphoreValidationError, Slot, bounded
from celery_semaphore.integration.waiting_room.handoffs import publisher_for
from celery_semaphore.testing import RedisServer

from . import history
from .helpers import Published, wait_for
from .history import BODIES, History


def _served(sem: Semaphore, published: Published, held: Slot) -> list[str]:
    """Serve the room of "k" (limit 1) to its end, one run at a time; the waiters in the
    order they were handed the slot."""
    held.release()
    order: list[str] = []
    while len(order) < len(published.waiters):
        waiter = published.waiters[len(order)]
        order.append(waiter)
        slot = sem.room.claim("k", waiter)
        assert isinstance(slot, Slot)
        slot.release()
    return order


def test_a_head_start_passes_newer_waiters_and_no_older_one(redis_server: RedisServer) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    held = sem.acquire("k")
    assert held is not None
    sem.room.park("k", "old", b"", waited=20.0)  # came 20 s ago
    for n in range(3):
        sem.room.park("k", f"new-{n}", b"")
    sem.room.park("k", "vip", b"", head_start=10.0)  # passes the new ones, not "old"
    sem.room.park("k", "vvip", b"", head_start=30.0)  # passes every one
    sem.room.park("k", "vip", b"", head_start=0.0)  # a re-park keeps its place
    assert [w.waiter for w in sem.room.waiters("k")] == [
        "vvip", "old", "vip", "new-0", "new-1", "new-2"
    ]  # fmt: skip
    # The views still show each run's real wait, not its head start.
    assert all(w.waited < 60 for w in sem.room.waiters("k"))
    assert _served(sem, published, held) == ["vvip", "old", "vip", "new-0", "new-1", "new-2"]
    sem.client.close()


def test_with_fair_turns_a_head_start_moves_one_run_never_before_the_head(
    redis_server: RedisServer,
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    held = sem.acquire("k")
    assert held is not None
    for n in range(6):
        sem.room.park("k", f"a-{n}", b"", tenant="a")
    sem.room.park("k", "b-0", b"", tenant="b")
    sem.room.park("k", "b-1", b"", tenant="b")
    sem.room.park("k", "b-vip", b"", tenant="b", head_start=60.0)
    sem.room.park("k", "b-2", b"", tenant="b")
    order = [w.waiter for w in sem.room.waiters("k")]
    # b-vip stands right after the head, never before it, beside the turn a new tenant's
    # first run was given there (ties go by id).
    assert order[0] == "a-0", order
    assert order.index("b-vip") <= 2, order
    # Tenant a keeps its order, and b's later run keeps its turn (b-vip did not pull it
    # forward): the tenants still alternate.
    assert [w for w in order if w.startswith("a-")] == [f"a-{n}" for n in range(6)]
    assert [w for w in order if w.startswith("b-") and w != "b-vip"] == ["b-0", "b-1", "b-2"]
    assert order.index("b-2") <= 7, order
    assert _served(sem, published, held) == order
    sem.client.close()


def test_with_fair_turns_no_newcomer_passes_the_head_whatever_its_id(
    redis_server: RedisServer,
) -> None:
    # The head's id sorts after every newcomer's: a newcomer given the head's own score
    # would pass it on the tie (as one did, in a public report, 32 times in a row).
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    held = sem.acquire("k")
    assert held is not None
    sem.room.park("k", "zz-low", b"", tenant="low")
    for n in range(4):
        sem.room.park("k", f"aa-high-{n}", b"", tenant="high", head_start=60.0)
        sem.room.park("k", f"ab-new-{n}", b"", tenant=f"new-{n}")
    order = [w.waiter for w in sem.room.waiters("k")]
    assert order[0] == "zz-low", order
    assert _served(sem, published, held)[0] == "zz-low"
    sem.client.close()


@pytest.mark.parametrize(
    "bad", [-1.0, 86_400.5, math.nan, math.inf, "10", True, [1]], ids=repr
)  # fmt: skip
def test_a_bad_head_start_is_refused_before_anything_is_written(
    redis_server: RedisServer, bad: object
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    sem = Semaphore(client, limit=1)
    with pytest.raises(SemaphoreValidationError, match="head_start"):
        sem.room.park("k", "w", b"", head_start=bad)  # type: ignore[arg-type]
    assert client.keys("*") == []
    client.close()


def test_a_bad_head_start_option_is_refused_at_decoration(app: Celery) -> None:
    with pytest.raises(SemaphoreValidationError, match="head_start"):
        bounded("k", 2, head_start=-5.0)(lambda: None)
    with pytest.raises(SemaphoreValidationError, match="head_start takes one key"):
        bounded([("a", 1), ("b", 1)], head_start=1.0)(lambda: None)


def test_a_bad_head_start_from_a_callable_fails_the_run_and_parks_nothing(
    app: Celery, client: redis.Redis
) -> None:
    @app.task(base=SemaphoreTask, semaphore="prio-bad", limit=1, head_start=lambda n: -n,
              shared=False, name="prio.bad")  # fmt: skip
    def bad(n: int) -> int:
        return n

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        result = bad.delay(3)
        with pytest.raises(SemaphoreValidationError, match="head_start"):
            result.get(timeout=30)
    assert client.keys("semaphore*prio-bad*") == []


def test_celery_priority_through_head_start_with_a_worker(
    redis_server: RedisServer, client: redis.Redis, app: Celery
) -> None:
    """A burst parks behind a held slot; runs marked urgent (a head start from the task's
    arguments) are sent last and start first, in their own arrival order; the rest keep
    theirs."""
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="prio", limit=1, shared=False, name="prio.call",
              head_start=lambda n, urgent: 60.0 if urgent else 0.0)  # fmt: skip
    def call(n: int, urgent: bool) -> int:
        with history.run(recorder, BODIES, "prio", data={"n": n}):
            pass
        return n

    sem = Semaphore(redis_server.url, limit=1, on_handoff=publisher_for(app))
    blocker = sem.acquire("prio")
    assert blocker is not None
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        results = [call.delay(n, False) for n in range(6)]
        assert wait_for(lambda: len(sem.room.waiters("prio")) == 6, timeout=60)
        results += [call.delay(n, True) for n in range(6, 8)]
        assert wait_for(lambda: len(sem.room.waiters("prio")) == 8, timeout=60)
        room = [w.waiter for w in sem.room.waiters("prio")]
        assert blocker.release()
        assert [r.get(timeout=60) for r in results] == list(range(8))
    runs = History.load(client, BODIES)
    runs.assert_ok({"prio": 1}, tasks=[r.id for r in results])
    # Two threads park the burst, so the room's order is the order the runs parked in, not
    # quite the order they were sent; the urgent two lead it, and the runs start in it.
    assert sorted(runs.values("n")[:2]) == [6, 7]
    assert {results[6].id, results[7].id} == set(room[:2])
    assert [run.task_id for run in runs.runs] == room
    recorder.close()
