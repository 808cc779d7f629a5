"""Waiting for a slot in the caller: ``acquire(wait=...)`` blocks until a release wakes it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_semaphore import Semaphore, SemaphoreValidationError, Slot
from celery_semaphore.core.names import redis_keys
from celery_semaphore.core.replies import MIN_BLOCK, Full
from celery_semaphore.testing import RedisServer

from .helpers import wait_for


@pytest.fixture
def sem(redis_server: RedisServer) -> Iterator[Semaphore]:
    semaphore = Semaphore(redis_server.url, limit=1, lease=30.0)
    yield semaphore
    semaphore.client.close()


class Waiter(threading.Thread):
    """A thread that calls ``sem.acquire(key, wait=wait)`` and keeps what it got."""

    def __init__(self, sem: Semaphore, wait: float, key: str = "k") -> None:
        super().__init__(daemon=True)
        self.sem, self.wait, self.key = sem, wait, key
        self.slot: Slot | None = None
        self.took = 0.0

    def run(self) -> None:
        started = time.monotonic()
        self.slot = self.sem.acquire(self.key, wait=self.wait)
        self.took = time.monotonic() - started


def _blocked(client: redis.Redis, key: str = "k") -> int:
    return int(client.zcard(redis_keys("semaphore", key).blocked))


def test_a_release_wakes_a_blocked_caller_at_once(sem: Semaphore, client: redis.Redis) -> None:
    holder = sem.acquire("k")
    assert holder is not None
    waiter = Waiter(sem, wait=60.0)
    waiter.start()
    assert wait_for(lambda: _blocked(client) == 1)
    holder.release()
    waiter.join(30)
    assert waiter.slot is not None
    # Woken by the release, not by its 30 s lease or its 60 s budget.
    assert waiter.took < 20
    waiter.slot.release()
    assert _blocked(client) == 0


def test_a_lapsed_lease_ends_the_block_without_a_release(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sem = Semaphore(redis_server.url, limit=1, lease=0.5)
    crashed = sem.acquire("k")  # never released: as if its process died
    assert crashed is not None
    started = time.monotonic()
    slot = sem.acquire("k", wait=60.0)
    assert slot is not None
    assert time.monotonic() - started < 30  # at the lease's end, not the 60 s budget
    slot.release()


def test_a_caller_that_is_never_woken_gives_up_after_its_wait(
    sem: Semaphore, client: redis.Redis
) -> None:
    holder = sem.acquire("k")
    assert holder is not None
    started = time.monotonic()
    assert sem.acquire("k", wait=0.5) is None
    assert time.monotonic() - started >= 0.5
    assert _blocked(client) == 0
    holder.release()
    for name in redis_keys("semaphore", "k"):  # nothing left without a TTL
        assert client.pttl(name) != -1, name


def test_a_wait_with_under_a_millisecond_left_blocks_for_a_moment(
    redis_server: RedisServer,
) -> None:
    # Redis 6.2 truncates a BLPOP timeout to whole ms, and reads 0 as "until a push": a
    # waiter with 0.2 ms of its budget left blocked until its socket timed out, and the call
    # failed as a backend error (it did in CI, on Redis 6.2) instead of finding the key full.
    full = Full(holders=1, now_ms=1_000, first_expiry_ms=61_000, limit=1)
    lapse = full.first_lapse(1_000, 0.0002)
    assert lapse == MIN_BLOCK
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=2.0,
                         retry=Retry(NoBackoff(), 0))  # fmt: skip
    try:
        assert client.blpop(["test:wake"], timeout=lapse) is None  # on each Redis supported
    finally:
        client.close()


def test_a_slot_handed_to_a_parked_run_wakes_nobody(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    handed: list[str] = []
    sem = Semaphore(
        redis_server.url,
        limit=1,
        on_handoff=lambda key, handoffs: handed.extend(h.waiter for h in handoffs),
    )
    holder = sem.acquire("k")
    assert holder is not None
    sem.room.park("k", "parked-first", b"p")
    waiter = Waiter(sem, wait=1.0)
    waiter.start()
    assert wait_for(lambda: _blocked(client) == 1)
    holder.release()
    waiter.join(30)
    assert handed == ["parked-first"]
    assert waiter.slot is None


def test_blocked_callers_take_freed_slots_one_each_never_above_the_limit(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sem = Semaphore(redis_server.url, limit=2, lease=30.0)
    holders = [sem.acquire("k"), sem.acquire("k")]
    waiters = [Waiter(sem, wait=60.0) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    assert wait_for(lambda: _blocked(client) == 4)
    for slot in holders:
        assert slot is not None
        slot.release()
    assert wait_for(lambda: sum(w.slot is not None for w in waiters) == 2)
    assert sem.count("k") == 2
    for waiter in [w for w in waiters if w.slot is not None]:
        assert waiter.slot is not None
        waiter.slot.release()
    for waiter in waiters:
        waiter.join(30)
    assert all(w.slot is not None for w in waiters)
    assert sem.count("k") == 2
    for waiter in waiters[:]:
        if waiter.slot is not None and not waiter.slot.released:
            waiter.slot.release()
    assert sem.count("k") == 0


@pytest.mark.parametrize(
    "options",
    [{"wait": -1.0}, {"wait": float("nan")}, {"wait": "1"}, {"wait": 1.0, "retries": 2}],
)
def test_bad_waits_are_refused_before_redis(
    sem: Semaphore, client: redis.Redis, options: dict[str, object]
) -> None:
    with pytest.raises(SemaphoreValidationError):
        sem.acquire("k", **options)  # type: ignore[arg-type]
    assert client.keys("semaphore:*") == []
