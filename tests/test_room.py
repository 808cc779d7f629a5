"""The waiting room in the core: park, hand-off on release, claim, sweep, cancel (real Redis)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from celery_semaphore import Semaphore, SemaphoreBackendError, SemaphoreValidationError, Slot
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.core.names import redis_keys
from celery_semaphore.core.replies import NotWaiting, Parked, RoomFull
from celery_semaphore.testing import RedisServer

from .helpers import Published, wait_for


@pytest.fixture
def sem(redis_server: RedisServer, published: Published) -> Iterator[Semaphore]:
    semaphore = Semaphore(redis_server.url, limit=2, lease=30.0, on_handoff=published)
    yield semaphore
    semaphore.client.close()


def _fill(sem: Semaphore, key: str = "k") -> list[Slot]:
    slots = [sem.acquire(key) for _ in range(sem.limit)]
    assert all(slots)
    return [s for s in slots if s is not None]


def test_a_release_hands_its_slot_to_the_parked_waiter(
    sem: Semaphore, published: Published
) -> None:
    first, _ = _fill(sem)
    parked = sem.room.park("k", "w1", b"message-1")
    assert parked == Parked(position=0, now_ms=parked.now_ms, limit=2)  # type: ignore[union-attr]
    assert [w.waiter for w in sem.room.waiters("k")] == ["w1"]
    assert first.release()
    assert published.handoffs == [("k", "w1", b"message-1")]
    assert sem.count("k") == 2  # the reservation holds the freed slot: no newcomer gets it
    assert sem.acquire("k") is None
    assert sem.room.waiters("k") == []
    claimed = sem.room.claim("k", "w1")
    assert isinstance(claimed, Slot)
    assert sem.count("k") == 2
    # A second delivery of the same hand-off finds nothing to claim, and must end quietly.
    assert isinstance(sem.room.claim("k", "w1"), NotWaiting)
    assert claimed.release()


def test_waiters_are_served_oldest_first(sem: Semaphore, published: Published) -> None:
    slots = _fill(sem)
    now = time.time()
    for i, waiter in enumerate(["c", "a", "b"]):  # arrivals given out of order
        assert isinstance(sem.room.park("k", waiter, b"", arrival=now - 10 + [3, 1, 2][i]), Parked)
    assert [w.waiter for w in sem.room.waiters("k")] == ["a", "b", "c"]
    for slot in slots:
        slot.release()
    assert published.waiters == ["a", "b"]
    claimed = sem.room.claim("k", "a")
    assert isinstance(claimed, Slot)
    claimed.release()
    assert published.waiters == ["a", "b", "c"]


def test_park_takes_a_free_slot_only_when_no_older_waiter_waits(sem: Semaphore) -> None:
    assert isinstance(sem.room.park("free", "w", b""), Slot)
    assert sem.room.waiters("free") == []


def test_a_waiter_parked_again_keeps_its_first_arrival_and_takes_the_new_payload(
    sem: Semaphore, published: Published
) -> None:
    slots = _fill(sem)
    sem.room.park("k", "old", b"v1", arrival=time.time() - 60)
    sem.room.park("k", "new", b"n")
    sem.room.park("k", "old", b"v2")
    assert [w.waiter for w in sem.room.waiters("k")] == ["old", "new"]
    slots[0].release()
    assert published.handoffs == [("k", "old", b"v2")]


def test_an_unclaimed_reservation_lapses_and_its_waiter_is_handed_the_next_slot(
    redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=1, claim_timeout=0.2, on_handoff=published)
    holder = sem.acquire("k")
    assert holder is not None
    sem.room.park("k", "w1", b"p")
    sem.room.park("k", "w2", b"p")
    holder.release()
    assert published.waiters == ["w1"]
    # Nobody claims: after the claim timeout a sweep requeues w1 at the head and hands the
    # slot to it again, publishing it a second time.
    assert wait_for(lambda: sem.room.sweep("k") == 1, timeout=10)
    assert published.waiters == ["w1", "w1"]
    claimed = sem.room.claim("k", "w1")
    assert isinstance(claimed, Slot)
    claimed.release()
    assert published.waiters == ["w1", "w1", "w2"]


def _lapsed_handoff(url: str, published: Published) -> Semaphore:
    """Limit 1: w1 parked, the holder released (handing w1 the slot), the claim lease over."""
    sem = Semaphore(url, limit=1, claim_timeout=0.1, on_handoff=published)
    holder = sem.acquire("k")
    assert holder is not None
    sem.room.park("k", "w1", b"p")
    holder.release()
    time.sleep(0.2)  # past the claim timeout: the point of the tests that use this
    return sem


def test_a_claim_after_the_reservation_lapsed_takes_the_slot_if_it_is_still_first(
    redis_server: RedisServer, published: Published
) -> None:
    sem = _lapsed_handoff(redis_server.url, published)
    assert isinstance(sem.room.claim("k", "w1"), Slot)


def test_a_reservation_pruned_by_a_plain_acquire_is_requeued_by_a_sweep(
    redis_server: RedisServer, published: Published
) -> None:
    sem = _lapsed_handoff(redis_server.url, published)
    newcomer = sem.acquire("k")  # prunes it without knowing the room
    assert newcomer is not None
    assert sem.room.waiters("k") == []
    assert sem.room.sweep("k") == 0  # no free slot, but w1 is back in the room
    assert [w.waiter for w in sem.room.waiters("k")] == ["w1"]
    newcomer.release()
    assert published.waiters == ["w1", "w1"]


def test_a_sweep_of_a_large_room_finds_a_pruned_reservation_by_its_due_time(
    redis_server: RedisServer, published: Published
) -> None:
    """Proves: a sweep of a room of thousands, which looks over only a page of the room per
    call, still puts back at once the waiter a plain acquire orphaned: it finds it by its
    reservation's lapse, noted when it was handed off."""
    sem = Semaphore(redis_server.url, limit=1, claim_timeout=0.1, on_handoff=published)
    holder = sem.acquire("big")
    assert holder is not None
    sem.room.park("big", "first", b"p")
    for n in range(3000):  # arrivals that tie with the first sort after it, by id
        sem.room.park("big", f"then-{n}", b"p")
    holder.release()
    assert published.waiters == ["first"]
    time.sleep(0.2)  # past the claim timeout: the point of the test
    plain = Semaphore(redis_server.url, limit=1)  # a process that never saw the room
    # An acquire of several keys does not look at the rooms (a plain acquire would wait
    # behind them): it prunes first's reservation without putting it back.
    newcomer = plain.acquire_many([("big", 1)])
    assert newcomer is not None
    _, head = sem.room.head("big")
    assert head is not None
    assert head.waiter == "then-0"  # first is in no order now
    assert sem.room.sweep("big") == 0
    count, head = sem.room.head("big")
    assert (count, head.waiter if head else None) == (3001, "first")


def test_a_plain_acquire_waits_behind_the_room_so_light_runs_cannot_starve_a_heavy_one(
    redis_server: RedisServer, published: Published
) -> None:
    # A weight-4 run waits at the head for the whole limit; light callers that ask in person
    # (on_full="wait" runs, plain acquires) find units free, but those are the room's.
    sem = Semaphore(redis_server.url, limit=4, on_handoff=published)
    light = sem.acquire("k")
    assert light is not None
    assert isinstance(sem.room.park("k", "heavy", b"p", weight=4), Parked)
    assert sem.acquire("k") is None  # three units free, and still refused
    asyncio.run(_async_refused(redis_server.url))
    assert light.release()
    assert published.waiters == ["heavy"]  # the release hands it all four
    heavy = sem.room.claim("k", "heavy", weight=4)
    assert isinstance(heavy, Slot)
    assert heavy.release()
    assert sem.acquire("k") is not None  # the room is empty: plain acquires go again
    sem.client.close()


async def _async_refused(url: str) -> None:
    async with AsyncSemaphore(url, limit=4) as sem:
        assert await sem.acquire("k") is None


def test_cancel_takes_a_waiter_out_and_passes_its_reservation_on(
    sem: Semaphore, published: Published
) -> None:
    slots = _fill(sem)
    for waiter in ["w1", "w2", "w3"]:
        sem.room.park("k", waiter, b"")
    assert sem.room.cancel("k", "w2")
    assert not sem.room.cancel("k", "w2")
    slots[0].release()
    assert published.waiters == ["w1"]
    assert sem.room.cancel("k", "w1")  # reserved: its slot goes to the next waiter
    assert published.waiters == ["w1", "w3"]
    assert sem.room.waiters("k") == []


def test_max_queued_refuses_a_new_waiter_but_not_a_parked_one(sem: Semaphore) -> None:
    _fill(sem)
    assert isinstance(sem.room.park("k", "w1", b"", max_queued=1), Parked)
    assert sem.room.park("k", "w2", b"", max_queued=1) == RoomFull(queued=1)
    assert isinstance(sem.room.park("k", "w1", b"", max_queued=1), Parked)


def test_room_keys_expire_and_bad_arguments_are_refused_before_redis(
    sem: Semaphore, client: redis.Redis
) -> None:
    _fill(sem)
    sem.room.park("k", "w1", b"", room_ttl=120.0, deadline=time.time() + 60)
    keys = redis_keys(sem.prefix, "k")
    # blocked and wake: see test_wait.py; limits (a live limit) persists: see test_limits.py;
    # no holders hash: each holder's record is in its member
    for name in [keys.slots, keys.room, keys.parked, keys.deadlines,
                 sem.room.index.key]:  # fmt: skip
        assert 0 < client.pttl(name) <= 120_000, name
    for bad in [
        lambda: sem.room.park("k", "~w", b""),
        lambda: sem.room.park("k", "!limit", b""),
        lambda: sem.room.park("k", "", b""),
        lambda: sem.room.park("k", "w", "text"),  # type: ignore[arg-type]
        lambda: sem.room.park("k", "w", b"", max_queued=-1),
        lambda: sem.room.park("k", "w", b"", limit=0),
        lambda: sem.room.park("k", "w", b"", room_ttl=0),
        lambda: sem.room.park("k", "w", b"", deadline=-1.0),
        lambda: sem.room.park("k", "w", b"", deadline=float("nan")),
        lambda: sem.room.park("k", "w", b"", waited=-1.0),
        lambda: sem.room.park("k", "w", b"", waited=1.0, arrival=time.time()),
        lambda: sem.room.park("k", "w", b"", budget=0),
        lambda: sem.room.park("k", "w", b"", budget=5.0, deadline=time.time() + 5),
        lambda: sem.room.park_many([("k", 1)], "w", b"", budget=-1.0),
        lambda: Semaphore(client, limit=1, claim_timeout=0),
        lambda: Semaphore(client, limit=1, handoff_grace=-0.1),
        lambda: Semaphore(client, limit=1, on_handoff="publish"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(SemaphoreValidationError):
            bad()
    assert [w.waiter for w in sem.room.waiters("k")] == ["w1"]


def test_a_room_of_10000_drains_in_order_with_nothing_lost(
    redis_server: RedisServer, published: Published
) -> None:
    # Leases longer than the test: 20,000 round trips on a loaded machine can outlast the
    # default lease, and a lapsed holder would let a park take its slot.
    sem = Semaphore(redis_server.url, limit=5, lease=3600.0, on_handoff=published)
    running = _fill(sem, "big")
    count = 10_000
    start = time.time() - count
    for n in range(count):
        assert isinstance(sem.room.park("big", f"w{n:05d}", b"", arrival=start + n), Parked)
    served: list[str] = []
    while running:
        slot = running.pop(0)
        slot.release()
        while len(served) < len(published.waiters):
            waiter = published.waiters[len(served)]
            served.append(waiter)
            claimed = sem.room.claim("big", waiter)
            assert isinstance(claimed, Slot), waiter
            running.append(claimed)
    assert served == [f"w{n:05d}" for n in range(count)]
    assert sem.count("big") == 0
    assert sem.room.waiters("big") == []


def test_a_release_that_cannot_publish_leaves_the_slot_for_a_sweep(
    redis_server: RedisServer, sem: Semaphore, published: Published
) -> None:
    mute = Semaphore(redis_server.url, limit=2)  # no on_handoff: it cannot start a run
    slots = [mute.acquire("k"), mute.acquire("k")]
    sem.room.park("k", "w1", b"p")
    for slot in slots:
        assert slot is not None
        assert slot.release()
    assert mute.count("k") == 0  # nothing reserved for a run nobody would start
    assert [w.waiter for w in sem.room.waiters("k")] == ["w1"]
    assert sem.room.sweep("k") == 1
    assert published.waiters == ["w1"]


def test_a_waiter_past_its_deadline_is_given_up_until_its_run_cancels_it(
    redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=1, claim_timeout=0.2, on_handoff=published)
    holder = sem.acquire("k")
    assert holder is not None
    sem.room.park("k", "late", b"p", deadline=time.time() + 0.1)
    sem.room.park("k", "patient", b"p")
    assert wait_for(lambda: sem.room.sweep("k") == 1, timeout=10)
    assert published.give_ups == ["late"]
    # Still parked until its run cancels it; a give-up whose message was lost is sent again.
    assert [w.waiter for w in sem.room.waiters("k")] == ["late", "patient"]
    assert wait_for(lambda: sem.room.sweep("k") == 1, timeout=10)
    assert published.give_ups == ["late", "late"]
    assert sem.room.cancel("k", "late")
    holder.release()
    assert published.waiters == ["patient"]
    claimed = sem.room.claim("k", "patient")
    assert isinstance(claimed, Slot)
    assert sem.room.sweep("k") == 0
    assert published.give_ups == ["late", "late"]
    claimed.release()


def test_a_hand_off_that_comes_before_the_deadline_ends_the_give_ups(
    redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    holder = sem.acquire("k")
    assert holder is not None
    sem.room.park("k", "w", b"p", deadline=time.time() + 0.3)
    holder.release()
    claimed = sem.room.claim("k", "w")
    assert isinstance(claimed, Slot)
    time.sleep(0.4)  # past the deadline it no longer has: the point of the test
    assert sem.room.sweep("k") == 0
    assert published.give_ups == []
    claimed.release()


def test_sweeps_find_rooms_through_the_index_and_a_full_scan_finds_the_rest(
    sem: Semaphore, client: redis.Redis
) -> None:
    slots = _fill(sem)
    sem.room.park("k", "w1", b"p")
    _fill(sem, "unindexed")
    sem.room.park("unindexed", "w2", b"p")
    client.zrem(sem.room.index.key, "unindexed")  # as if its parker died before indexing
    assert sem.room.index.rooms() == ["k"]
    assert sem.room.index.rooms(full_scan=True) == ["k", "unindexed"]
    assert sem.room.cancel("k", "w1")
    sem.room.sweep("k")  # the room is gone: it leaves the index
    assert sem.room.index.rooms() == []
    for slot in slots:
        slot.release()


def test_a_sweep_scores_its_room_with_when_something_in_it_next_falls_due(
    sem: Semaphore, client: redis.Redis
) -> None:
    """Proves: a room where nothing can fall due is scored ``idle`` ahead by its sweep, not
    one interval; a waiter parked afterwards with a budget brings the room's score down to
    its deadline; and a holder's lease end counts while anyone waits."""
    index = sem.room.index
    slots = _fill(sem)  # leases of 30 s
    sem.room.park("k", "patient", b"p")

    def score() -> float:
        found = client.zscore(index.key, "k")
        assert found is not None
        seconds, micros = client.time()
        return float(found) / 1000 - (seconds + micros / 1e6)

    sem.room.sweep_many(["k"], idle=20.0)
    assert 14 <= score() <= 20.5  # nothing due sooner (the holders' leases end in 30 s)
    sem.room.park("k", "hurried", b"p", budget=5.0)
    assert 3.5 <= score() <= 5.5  # its deadline, written by the park itself
    sem.room.sweep_many(["k"], idle=60.0)
    assert 3.5 <= score() <= 5.5  # the deadline, which the sweep reads in the room
    assert sem.room.cancel("k", "hurried")
    sem.room.sweep_many(["k"], idle=60.0)
    assert 21 <= score() <= 30.5  # the first holder's lease end, sooner than the idle 60 s
    for slot in slots:
        slot.release()


def test_what_a_sweep_could_not_see_brings_its_rooms_sweep_on(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    """Proves: a room scored far ahead by its last sweep is brought on by a release that
    leaves its freed slot to the sweep (its process cannot publish: due at once), and by a
    reservation that lapses before the room's next sweep (due at its lapse); the
    last run to claim deletes the drained room at once."""
    quiet = Semaphore(redis_server.url, limit=1)  # no on_handoff: cannot publish
    quick = Semaphore(redis_server.url, limit=1, claim_timeout=0.5, on_handoff=Published())
    index = quiet.room.index

    def due_in() -> float:
        score = client.zscore(index.key, "k")
        assert score is not None
        seconds, micros = client.time()
        return float(score) / 1000 - (seconds + micros / 1e6)

    holder = quiet.acquire("k")
    assert holder is not None
    quiet.room.park("k", "w1", b"p")
    quiet.room.park("k", "w2", b"p")
    quiet.room.sweep_many(["k"], idle=20.0)
    assert due_in() > 10
    assert holder.release()  # left free for the sweep
    assert due_in() < 0  # due at once
    assert quick.room.sweep("k") == 1  # the sweep hands the slot to w1 (published, 0.5 s)
    quiet.room.sweep_many(["k"], idle=20.0)  # a sweep of a room with a 0.5 s claim lease...
    assert due_in() <= 0.6  # ...comes within it: the sweep scores the reservation's lapse
    first = quick.room.claim("k", "w1")
    assert isinstance(first, Slot)
    assert first.release()  # w2's reservation, 0.5 s: the room's score was already as soon
    assert due_in() <= 0.6
    last = quick.room.claim("k", "w2")
    assert isinstance(last, Slot)
    assert not client.exists(redis_keys("semaphore", "k").parked)  # the room went with w2
    assert last.release()
    quiet.client.close()
    quick.client.close()


@pytest.mark.parametrize("grace", [0.05, 0.0])
def test_a_run_that_parks_in_person_takes_a_reservation_unclaimed_past_the_grace(
    grace: float, redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published, handoff_grace=grace)
    holder = sem.acquire("k")
    assert holder is not None
    sem.room.park("k", "slow", b"p")  # its message will come late (behind a backlog, say)
    holder.release()
    assert published.waiters == ["slow"]
    time.sleep(0.1)  # past the grace: the point of the test
    here = sem.room.park("k", "here", b"p")
    if grace == 0:  # strict order: the reservation waits for its run
        assert isinstance(here, Parked)
        assert isinstance(sem.room.claim("k", "slow"), Slot)
        return
    assert isinstance(here, Slot)
    assert [w.waiter for w in sem.room.waiters("k")] == ["slow"]  # still at the head
    assert isinstance(sem.room.claim("k", "slow"), Parked)  # its message came: it waits on
    here.release()
    assert published.waiters == ["slow", "slow"]
    assert isinstance(sem.room.claim("k", "slow"), Slot)


def test_a_wait_and_a_budget_are_counted_on_the_servers_clock(
    redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    (running,) = _fill(sem)
    server_now = redis_server.client().time()[0]
    assert isinstance(sem.room.park("k", "w", b"p", waited=30.0, budget=0.3), Parked)
    (waiter,) = sem.room.waiters("k")
    # Parked 30 s before the server's now, whatever this process's clock says.
    assert abs(waiter.arrival - (server_now - 30)) < 5, (waiter.arrival, server_now)
    # Its budget ran out 29.7 s ago: the next sweep gives it up.
    assert sem.room.sweep("k") == 1
    assert published.give_ups == ["w"]
    assert running.release()


def test_a_slot_whose_park_answer_was_lost_is_given_back_once_the_store_answers(
    own_redis: RedisServer, published: Published
) -> None:
    sem = Semaphore(own_redis.url, limit=1, lease=120.0, on_handoff=published)
    _load_scripts(sem)
    own_redis.pause()
    try:
        with pytest.raises(SemaphoreBackendError):
            sem.room.park("k", "w1", lambda: b"p1")  # a free key: it takes the slot
    finally:
        own_redis.resume()
    woke = time.monotonic()
    # Nobody holds the slot that park took: it goes back instead of standing for its lease.
    assert wait_for(lambda: sem.count("k") == 0, timeout=60)
    assert time.monotonic() - woke < 30, "the slot waited for its lease"


def _load_scripts(sem: Semaphore) -> None:
    """Run park and release once, so that a call sent to the frozen server is an EVALSHA it
    runs when it wakes (on a fresh server it would answer NOSCRIPT, and do nothing)."""
    slot = sem.room.park("warm-up", "w0", b"")
    assert isinstance(slot, Slot)
    assert slot.release()


def _index(client: redis.Redis, sem: Semaphore) -> dict[str, float]:
    return {k.decode(): s for k, s in client.zrange(sem.room.index.key, 0, -1, withscores=True)}


def test_the_index_hands_each_due_room_to_one_caller_and_again_an_interval_later(
    redis_server: RedisServer, sem: Semaphore, client: redis.Redis
) -> None:
    keys = [f"k{n}" for n in range(10)]
    slots = [slot for key in keys for slot in _fill(sem, key)]
    for key in keys:
        assert isinstance(sem.room.park(key, f"w-{key}", b"p"), Parked)
    assert set(_index(client, sem).values()) == {0}  # new rooms are due at once
    # Two workers' sweepers, each with a client of its own.
    a, b = (Semaphore(redis_server.url, limit=2).room.index for _ in range(2))
    first = a.due(interval=1.0, count=4, ttl=60.0)
    second = b.due(interval=1.0, count=100, ttl=60.0)
    assert len(first.keys) == 4
    assert len(second.keys) == 6
    assert sorted(first.keys + second.keys) == keys
    assert first.next_ms <= first.now_ms  # more were due than it took
    third = a.due(interval=1.0, count=100, ttl=60.0)
    assert third.keys == ()  # every room is another's until its interval is over
    assert third.now_ms < third.next_ms <= third.now_ms + 1000
    # Neither swept its rooms (both died, say): one interval later they are due again.
    again: list[str] = []
    assert wait_for(lambda: again.extend(b.due(1.0, 100, 60.0).keys) or len(again) == 10, 10)
    assert sorted(again) == keys
    for slot in slots:
        slot.release()


def test_a_park_never_puts_off_a_rooms_sweep_and_a_room_made_again_stays_indexed(
    sem: Semaphore, client: redis.Redis
) -> None:
    slots = _fill(sem)
    sem.room.park("k", "w1", b"p")
    taken = sem.room.index.due(interval=60.0, count=10, ttl=60.0)
    assert taken.keys == ("k",)
    due_at = taken.now_ms + 60_000
    assert _index(client, sem) == {"k": due_at}
    sem.room.park("k", "w2", b"p")  # a park into a room already indexed
    sem.room.index.add("k", 60_000, new_room=True)
    assert _index(client, sem) == {"k": due_at}
    # A sweep that found the room gone takes it out; a park made it again meanwhile.
    sem.room.index.drop("k")
    assert _index(client, sem) == {"k": 0}
    assert sem.room.cancel("k", "w1")
    assert sem.room.cancel("k", "w2")
    sem.room.sweep("k")  # gone for good: out of the index
    assert _index(client, sem) == {}
    for slot in slots:
        slot.release()


def test_the_fleet_scans_the_keyspace_for_unindexed_rooms_once_a_period(
    redis_server: RedisServer, sem: Semaphore, client: redis.Redis
) -> None:
    slots = _fill(sem, "unindexed")
    sem.room.park("unindexed", "w", b"p")
    client.delete(sem.room.index.key)  # as if its parker died before indexing
    a, b = (Semaphore(redis_server.url, limit=2).room.index for _ in range(2))
    assert a.backstop(every=60.0, owner="a", ttl=30.0) == 1
    assert b.backstop(every=60.0, owner="b", ttl=30.0) is None  # a scanned for the fleet
    assert client.get(sem.room.index.names.room_scan) == b"a"
    assert _index(client, sem) == {"unindexed": 0}  # due at once
    assert 0 < client.pttl(sem.room.index.key) <= 30_000
    client.delete(sem.room.index.names.room_scan)  # the period is over
    assert b.backstop(every=60.0, owner="b", ttl=30.0) == 0
    for slot in slots:
        slot.release()


def test_many_rooms_are_swept_in_one_pipeline_and_each_as_on_its_own(
    sem: Semaphore, client: redis.Redis, published: Published
) -> None:
    mute = Semaphore(sem.client, limit=2)  # no on_handoff: its releases reserve nothing
    held = {key: [mute.acquire(key), mute.acquire(key)] for key in ("a", "b", "gone")}
    for key in ("a", "b", "gone"):
        sem.room.park(key, f"w-{key}", b"p")
    assert sem.room.cancel("gone", "w-gone")
    for slots in held.values():
        for slot in slots:
            assert slot is not None
            assert slot.release()
    client.script_flush()  # as after a restart of the store: NOSCRIPT, loaded, sent again
    assert sem.room.sweep_many(["a", "b", "gone"]) == 2
    assert sorted(published.waiters) == ["w-a", "w-b"]
    assert "gone" not in sem.room.index.rooms()  # its room was found gone
    assert sem.room.sweep_many([]) == 0
    with pytest.raises(SemaphoreValidationError):
        sem.room.sweep_many(["a", ""])
