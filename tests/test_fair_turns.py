"""Fair turns in the waiting room, on a real Redis: runs parked with a group (``fair_by``)
take turns across groups, so one tenant's burst does not hold back another's few runs."""

from __future__ import annotations

import time

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Semaphore, SemaphoreTask, Slot
from celery_semaphore.testing import RedisServer

from . import history
from .helpers import Published, wait_for
from .history import BODIES, History

LIMIT = 5


def _start_order(sem: Semaphore, published: Published, held: list[Slot]) -> list[str]:
    """Serve the room to its end: each release hands a slot to the next waiter, whose run
    claims it and later releases it. Returns the waiters in the order they started."""
    order: list[str] = []
    while held:
        held.pop(0).release()
        while len(order) < len(published.waiters):
            waiter = published.waiters[len(order)]
            order.append(waiter)
            slot = sem.claim("k", waiter)
            assert isinstance(slot, Slot)
            held.append(slot)
    return order


def _park_a_burst_then_a_few(sem: Semaphore, group: bool) -> None:
    for n in range(30):
        sem.park("k", f"a-{n:02d}", b"", group="tenant:a" if group else "")
    for n in range(5):
        sem.park("k", f"b-{n}", b"", group="tenant:b" if group else "")


def test_a_late_tenant_takes_turns_with_a_burst(redis_server: RedisServer) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=LIMIT, on_handoff=published)
    held = [sem.acquire("k") for _ in range(LIMIT)]
    _park_a_burst_then_a_few(sem, group=True)
    order = _start_order(sem, published, [s for s in held if s is not None])
    positions = [order.index(f"b-{n}") for n in range(5)]
    assert max(positions) < 2 * LIMIT, order  # all of B within the first 2L starts
    assert [w for w in order if w.startswith("a-")] == [f"a-{n:02d}" for n in range(30)]
    assert [w for w in order if w.startswith("b-")] == [f"b-{n}" for n in range(5)]
    # The views still show each run's real wait, not its turn.
    assert all(w.waited < 60 for w in sem.admin.room("k"))


def test_without_groups_the_room_keeps_arrival_order(redis_server: RedisServer) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=LIMIT, on_handoff=published)
    held = [sem.acquire("k") for _ in range(LIMIT)]
    _park_a_burst_then_a_few(sem, group=False)
    order = _start_order(sem, published, [s for s in held if s is not None])
    assert order == [f"a-{n:02d}" for n in range(30)] + [f"b-{n}" for n in range(5)]


def test_fair_by_with_a_worker(redis_server: RedisServer, client: redis.Redis, app: Celery) -> None:
    """Tenant A sends 100 runs, then tenant B 5: B's runs all start within the first 4L
    starts after they arrive, by the bodies' own start times (without fair turns, after
    A's whole backlog)."""
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="provider-fair", limit=LIMIT,
              fair_by="tenant:{tenant}", shared=False, name="fair.call")  # fmt: skip
    def call(tenant: str, n: int) -> str:
        with history.run(recorder, BODIES, "provider-fair", data={"tenant": tenant}):
            time.sleep(0.02)
        return tenant

    sem = Semaphore(redis_server.url, limit=LIMIT)
    with start_worker(app, pool="threads", concurrency=8, perform_ping_check=False):
        burst = [call.delay("a", n) for n in range(100)]
        # B arrives once A's burst waits in the room (its messages all fetched), not behind
        # A's messages in the broker's queue, where no semaphore can reorder it.
        assert wait_for(
            lambda: client.llen("celery") == 0 and len(sem.admin.room("provider-fair")) >= 50,
            timeout=60,
        )
        arrived = time.monotonic()
        few = [call.delay("b", n) for n in range(5)]
        for r in burst + few:
            r.get(timeout=120)
    runs = History.load(client, BODIES)
    runs.assert_ok({"provider-fair": LIMIT}, tasks=[r.id for r in burst + few])
    after = [r.data["tenant"] for r in runs.runs if r.start > arrived]
    last_b = max(n for n, tenant in enumerate(after) if tenant == "b")
    print(
        f"\nB's runs started at {[n for n, t in enumerate(after) if t == 'b']} of the starts "
        f"after B arrived"
    )
    # Up to L slots were already handed to A's runs (their messages on the way), then the
    # two tenants take turns: B's five runs by about L + 2 x 5 starts, and well within 4L
    # (in arrival order they would start after A's 50 or more parked runs).
    assert last_b < 4 * LIMIT, after[: 4 * LIMIT]
    recorder.close()
