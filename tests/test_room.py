"""The waiting room in the core: park, hand-off on release, claim, sweep, cancel (real Redis)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_semaphore import Semaphore, SemaphoreValidationError, Slot
from celery_semaphore.core.scripts import NotWaiting, Parked, RoomFull, redis_keys
from celery_semaphore.testing import RedisServer

from .helpers import Published, wait_for


@pytest.fixture
def published() -> Published:
    return Published()


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
    parked = sem.park("k", "w1", b"message-1")
    assert parked == Parked(position=0, now_ms=parked.now_ms, limit=2)  # type: ignore[union-attr]
    assert [w.waiter for w in sem.admin.room("k")] == ["w1"]
    assert first.release()
    assert published.handoffs == [("k", "w1", b"message-1")]
    assert sem.count("k") == 2  # the reservation holds the freed slot: no newcomer gets it
    assert sem.acquire("k") is None
    assert sem.admin.room("k") == []
    claimed = sem.claim("k", "w1")
    assert isinstance(claimed, Slot)
    assert sem.count("k") == 2
    # A second delivery of the same hand-off finds nothing to claim, and must end quietly.
    assert isinstance(sem.claim("k", "w1"), NotWaiting)
    assert claimed.release()


def test_waiters_are_served_oldest_first(sem: Semaphore, published: Published) -> None:
    slots = _fill(sem)
    now = time.time()
    for i, waiter in enumerate(["c", "a", "b"]):  # arrivals given out of order
        assert isinstance(sem.park("k", waiter, b"", arrival=now - 10 + [3, 1, 2][i]), Parked)
    assert [w.waiter for w in sem.admin.room("k")] == ["a", "b", "c"]
    for slot in slots:
        slot.release()
    assert published.waiters == ["a", "b"]
    claimed = sem.claim("k", "a")
    assert isinstance(claimed, Slot)
    claimed.release()
    assert published.waiters == ["a", "b", "c"]


def test_park_takes_a_free_slot_only_when_no_older_waiter_waits(sem: Semaphore) -> None:
    assert isinstance(sem.park("free", "w", b""), Slot)
    assert sem.admin.room("free") == []


def test_a_waiter_parked_again_keeps_its_first_arrival_and_takes_the_new_payload(
    sem: Semaphore, published: Published
) -> None:
    slots = _fill(sem)
    sem.park("k", "old", b"v1", arrival=time.time() - 60)
    sem.park("k", "new", b"n")
    sem.park("k", "old", b"v2")
    assert [w.waiter for w in sem.admin.room("k")] == ["old", "new"]
    slots[0].release()
    assert published.handoffs == [("k", "old", b"v2")]


def test_an_unclaimed_reservation_lapses_and_its_waiter_is_handed_the_next_slot(
    redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=1, claim_timeout=0.2, on_handoff=published)
    holder = sem.acquire("k")
    assert holder is not None
    sem.park("k", "w1", b"p")
    sem.park("k", "w2", b"p")
    holder.release()
    assert published.waiters == ["w1"]
    # Nobody claims: after the claim timeout a sweep requeues w1 at the head and hands the
    # slot to it again, publishing it a second time.
    assert wait_for(lambda: sem.admin.sweep("k") == 1, timeout=10)
    assert published.waiters == ["w1", "w1"]
    claimed = sem.claim("k", "w1")
    assert isinstance(claimed, Slot)
    claimed.release()
    assert published.waiters == ["w1", "w1", "w2"]


def _lapsed_handoff(url: str, published: Published) -> Semaphore:
    """Limit 1: w1 parked, the holder released (handing w1 the slot), the claim lease over."""
    sem = Semaphore(url, limit=1, claim_timeout=0.1, on_handoff=published)
    holder = sem.acquire("k")
    assert holder is not None
    sem.park("k", "w1", b"p")
    holder.release()
    time.sleep(0.2)  # past the claim timeout: the point of the tests that use this
    return sem


def test_a_claim_after_the_reservation_lapsed_takes_the_slot_if_it_is_still_first(
    redis_server: RedisServer, published: Published
) -> None:
    sem = _lapsed_handoff(redis_server.url, published)
    assert isinstance(sem.claim("k", "w1"), Slot)


def test_a_reservation_pruned_by_a_plain_acquire_is_requeued_by_a_sweep(
    redis_server: RedisServer, published: Published
) -> None:
    sem = _lapsed_handoff(redis_server.url, published)
    newcomer = sem.acquire("k")  # prunes it without knowing the room
    assert newcomer is not None
    assert sem.admin.room("k") == []
    assert sem.admin.sweep("k") == 0  # no free slot, but w1 is back in the room
    assert [w.waiter for w in sem.admin.room("k")] == ["w1"]
    newcomer.release()
    assert published.waiters == ["w1", "w1"]


def test_cancel_takes_a_waiter_out_and_passes_its_reservation_on(
    sem: Semaphore, published: Published
) -> None:
    slots = _fill(sem)
    for waiter in ["w1", "w2", "w3"]:
        sem.park("k", waiter, b"")
    assert sem.admin.cancel("k", "w2")
    assert not sem.admin.cancel("k", "w2")
    slots[0].release()
    assert published.waiters == ["w1"]
    assert sem.admin.cancel("k", "w1")  # reserved: its slot goes to the next waiter
    assert published.waiters == ["w1", "w3"]
    assert sem.admin.room("k") == []


def test_max_queued_refuses_a_new_waiter_but_not_a_parked_one(sem: Semaphore) -> None:
    _fill(sem)
    assert isinstance(sem.park("k", "w1", b"", max_queued=1), Parked)
    assert sem.park("k", "w2", b"", max_queued=1) == RoomFull(queued=1)
    assert isinstance(sem.park("k", "w1", b"", max_queued=1), Parked)


def test_room_keys_expire_and_bad_arguments_are_refused_before_redis(
    sem: Semaphore, client: redis.Redis
) -> None:
    _fill(sem)
    sem.park("k", "w1", b"", room_ttl=120.0, deadline=time.time() + 60)
    keys = redis_keys(sem.prefix, "k")
    # blocked and wake: see test_wait.py; limits (a live limit) persists: see test_limits.py
    for name in [keys.slots, keys.holders, keys.room, keys.parked, keys.deadlines,
                 sem.admin.room_index]:  # fmt: skip
        assert 0 < client.pttl(name) <= 120_000, name
    for bad in [
        lambda: sem.park("k", "~w", b""),
        lambda: sem.park("k", "!limit", b""),
        lambda: sem.park("k", "", b""),
        lambda: sem.park("k", "w", "text"),  # type: ignore[arg-type]
        lambda: sem.park("k", "w", b"", max_queued=-1),
        lambda: sem.park("k", "w", b"", limit=0),
        lambda: sem.park("k", "w", b"", room_ttl=0),
        lambda: sem.park("k", "w", b"", deadline=-1.0),
        lambda: sem.park("k", "w", b"", deadline=float("nan")),
        lambda: Semaphore(client, limit=1, claim_timeout=0),
        lambda: Semaphore(client, limit=1, handoff_grace=-0.1),
        lambda: Semaphore(client, limit=1, on_handoff="publish"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(SemaphoreValidationError):
            bad()
    assert [w.waiter for w in sem.admin.room("k")] == ["w1"]


def test_a_room_of_10000_drains_in_order_with_nothing_lost(
    redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=5, on_handoff=published)
    running = _fill(sem, "big")
    count = 10_000
    start = time.time() - count
    for n in range(count):
        assert isinstance(sem.park("big", f"w{n:05d}", b"", arrival=start + n), Parked)
    served: list[str] = []
    while running:
        slot = running.pop(0)
        slot.release()
        while len(served) < len(published.waiters):
            waiter = published.waiters[len(served)]
            served.append(waiter)
            claimed = sem.claim("big", waiter)
            assert isinstance(claimed, Slot), waiter
            running.append(claimed)
    assert served == [f"w{n:05d}" for n in range(count)]
    assert sem.count("big") == 0
    assert sem.admin.room("big") == []


def test_a_release_that_cannot_publish_leaves_the_slot_for_a_sweep(
    redis_server: RedisServer, sem: Semaphore, published: Published
) -> None:
    mute = Semaphore(redis_server.url, limit=2)  # no on_handoff: it cannot start a run
    slots = [mute.acquire("k"), mute.acquire("k")]
    sem.park("k", "w1", b"p")
    for slot in slots:
        assert slot is not None
        assert slot.release()
    assert mute.count("k") == 0  # nothing reserved for a run nobody would start
    assert [w.waiter for w in sem.admin.room("k")] == ["w1"]
    assert sem.admin.sweep("k") == 1
    assert published.waiters == ["w1"]


def test_a_waiter_past_its_deadline_is_given_up_until_its_run_cancels_it(
    redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=1, claim_timeout=0.2, on_handoff=published)
    holder = sem.acquire("k")
    assert holder is not None
    sem.park("k", "late", b"p", deadline=time.time() + 0.1)
    sem.park("k", "patient", b"p")
    assert wait_for(lambda: sem.admin.sweep("k") == 1, timeout=10)
    assert published.give_ups == ["late"]
    # Still parked until its run cancels it; a give-up whose message was lost is sent again.
    assert [w.waiter for w in sem.admin.room("k")] == ["late", "patient"]
    assert wait_for(lambda: sem.admin.sweep("k") == 1, timeout=10)
    assert published.give_ups == ["late", "late"]
    assert sem.admin.cancel("k", "late")
    holder.release()
    assert published.waiters == ["patient"]
    claimed = sem.claim("k", "patient")
    assert isinstance(claimed, Slot)
    assert sem.admin.sweep("k") == 0
    assert published.give_ups == ["late", "late"]
    claimed.release()


def test_a_hand_off_that_comes_before_the_deadline_ends_the_give_ups(
    redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    holder = sem.acquire("k")
    assert holder is not None
    sem.park("k", "w", b"p", deadline=time.time() + 0.3)
    holder.release()
    claimed = sem.claim("k", "w")
    assert isinstance(claimed, Slot)
    time.sleep(0.4)  # past the deadline it no longer has: the point of the test
    assert sem.admin.sweep("k") == 0
    assert published.give_ups == []
    claimed.release()


def test_sweeps_find_rooms_through_the_index_and_a_full_scan_finds_the_rest(
    sem: Semaphore, client: redis.Redis
) -> None:
    slots = _fill(sem)
    sem.park("k", "w1", b"p")
    _fill(sem, "unindexed")
    sem.park("unindexed", "w2", b"p")
    client.zrem(sem.admin.room_index, "unindexed")  # as if its parker died before indexing
    assert sem.admin.rooms() == ["k"]
    assert sem.admin.rooms(full_scan=True) == ["k", "unindexed"]
    assert sem.admin.cancel("k", "w1")
    sem.admin.sweep("k")  # the room is gone: it leaves the index
    assert sem.admin.rooms() == []
    for slot in slots:
        slot.release()


@pytest.mark.parametrize("grace", [0.05, 0.0])
def test_a_run_that_parks_in_person_takes_a_reservation_unclaimed_past_the_grace(
    grace: float, redis_server: RedisServer, published: Published
) -> None:
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published, handoff_grace=grace)
    holder = sem.acquire("k")
    assert holder is not None
    sem.park("k", "slow", b"p")  # its message will come late (behind a backlog, say)
    holder.release()
    assert published.waiters == ["slow"]
    time.sleep(0.1)  # past the grace: the point of the test
    here = sem.park("k", "here", b"p")
    if grace == 0:  # strict order: the reservation waits for its run
        assert isinstance(here, Parked)
        assert isinstance(sem.claim("k", "slow"), Slot)
        return
    assert isinstance(here, Slot)
    assert [w.waiter for w in sem.admin.room("k")] == ["slow"]  # still at the head
    assert isinstance(sem.claim("k", "slow"), Parked)  # its message came: it waits on
    here.release()
    assert published.waiters == ["slow", "slow"]
    assert isinstance(sem.claim("k", "slow"), Slot)
