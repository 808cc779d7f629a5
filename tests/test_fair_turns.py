"""Fair turns in the waiting room, on a real Redis: runs parked with a group (``fair_by``)
take turns across groups, so one tenant's burst does not hold back another's few runs."""

from __future__ import annotations

import json
import time

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Semaphore, SemaphoreTask, Slot
from celery_semaphore.core.names import redis_keys
from celery_semaphore.integration.waiting_room.handoffs import publisher_for
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
            slot = sem.room.claim("k", waiter)
            assert isinstance(slot, Slot)
            held.append(slot)
    return order


def _park_a_burst_then_a_few(sem: Semaphore, group: bool) -> None:
    for n in range(30):
        sem.room.park("k", f"a-{n:02d}", b"", tenant="tenant:a" if group else "")
    for n in range(5):
        sem.room.park("k", f"b-{n}", b"", tenant="tenant:b" if group else "")


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
    assert all(w.waited < 60 for w in sem.room.waiters("k"))


def test_without_groups_the_room_keeps_arrival_order(redis_server: RedisServer) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=LIMIT, on_handoff=published)
    held = [sem.acquire("k") for _ in range(LIMIT)]
    _park_a_burst_then_a_few(sem, group=False)
    order = _start_order(sem, published, [s for s in held if s is not None])
    assert order == [f"a-{n:02d}" for n in range(30)] + [f"b-{n}" for n in range(5)]


def _all_arrived(client: redis.Redis, key: str, few: set[str]) -> tuple[float, set[str]]:
    """Poll until every task of ``few`` is parked in ``key``'s room (or already past it);
    then the instant and the runs that held a reservation then (their slots were handed
    out before the last of ``few`` could be served). Read in one transaction each time."""
    names = redis_keys("semaphore", key)
    while True:
        with client.pipeline(transaction=True) as pipe:
            pipe.hkeys(names.parked)
            pipe.zrange(names.slots, 0, -1)
            pipe.lrange(history.history_key(BODIES), 0, -1)
            parked, members, records = pipe.execute()
        at = time.monotonic()
        started = {json.loads(raw)["task"] for raw in records}
        if few <= {p.decode() for p in parked} | started:
            return at, {m.decode()[1:] for m in members if m.startswith(b"~")}
        time.sleep(0.002)


def test_fair_by_with_a_worker(redis_server: RedisServer, client: redis.Redis, app: Celery) -> None:
    """Tenant A sends 100 runs, then tenant B 5: B's runs all start within the first 2L
    starts after they arrive (the starts after all five wait in the room, less the runs
    whose slots were handed out before then), by the bodies' own start times; and within
    4L of the starts after B was sent (in arrival order they would start after A's 50 or
    more parked runs)."""
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="provider-fair", limit=LIMIT,
              fair_by="tenant:{tenant}", shared=False, name="fair.call")  # fmt: skip
    def call(tenant: str, n: int) -> str:
        with history.run(recorder, BODIES, "provider-fair", data={"tenant": tenant}):
            time.sleep(0.1)  # long enough that B's arrival is seen before B's runs start
        return tenant

    sem = Semaphore(redis_server.url, limit=LIMIT, on_handoff=publisher_for(app))
    # Every slot is held while A's burst arrives, so that all of it parks, however slow the
    # machine: a burst that starts as it arrives may run down to fewer than 50 parked before
    # its last message is fetched. Released, they hand their slots to A's oldest runs.
    blockers = [sem.acquire("provider-fair") for _ in range(LIMIT)]
    with start_worker(app, pool="threads", concurrency=8, perform_ping_check=False):
        burst = [call.delay("a", n) for n in range(100)]
        # B arrives once A's burst waits in the room (its messages all fetched), not behind
        # A's messages in the broker's queue, where no semaphore can reorder it.
        assert wait_for(
            lambda: client.llen("celery") == 0 and len(sem.room.waiters("provider-fair")) >= 50,
            timeout=60,
        )
        for blocker in blockers:
            assert blocker is not None
            assert blocker.release()
        # B is sent once A's runs follow one another through the room, as they would had
        # they started as they arrived: not amid the first hand-offs, all at once.
        assert wait_for(lambda: len(sem.room.waiters("provider-fair")) <= 100 - 3 * LIMIT)
        sent = time.monotonic()
        few = [call.delay("b", n) for n in range(5)]
        arrived, handed = _all_arrived(recorder, "provider-fair", {r.id for r in few})
        for r in burst + few:
            r.get(timeout=120)
    runs = History.load(client, BODIES)
    runs.assert_ok({"provider-fair": LIMIT}, tasks=[r.id for r in burst + few])
    after_sent = [r.data["tenant"] for r in runs.runs if r.start > sent]
    after_arrival = [
        r.data["tenant"] for r in runs.runs if r.start > arrived and r.task_id not in handed
    ]
    b_sent = [n for n, t in enumerate(after_sent) if t == "b"]
    b_arrived = [n for n, t in enumerate(after_arrival) if t == "b"]
    print(
        f"\nB's runs started at {b_sent} of the starts after B was sent, {b_arrived} of those"
        f" after all of B arrived ({len(handed)} slot(s) were on their way to A's runs then)"
    )
    # Up to L slots may already be on their way to A's runs when B is sent; after that the
    # two tenants take turns, so B's last run is about the 2 x 5th start.
    assert max(b_arrived, default=0) < 2 * LIMIT, after_arrival[: 2 * LIMIT]
    assert max(b_sent) < 4 * LIMIT, after_sent[: 4 * LIMIT]
    recorder.close()
