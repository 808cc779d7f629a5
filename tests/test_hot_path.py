"""The hot path's cached pieces behave like what they replace: tokens stay unique (across a
fork too), a lazy ``lost`` event is an Event, and memoised argument checks still refuse."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import redis

from celery_semaphore import Semaphore, SemaphoreValidationError, Slot
from celery_semaphore.core.lazy_event import LazyEvent
from celery_semaphore.core.process import new_token, pid
from celery_semaphore.core.replies import Parked
from celery_semaphore.testing import RedisServer

from .helpers import Published


def test_tokens_are_unique_and_a_forked_child_draws_its_own_and_knows_its_pid() -> None:
    mine = [new_token() for _ in range(10_000)]
    assert len(set(mine)) == len(mine)
    assert pid() == os.getpid()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report its pids and tokens, and leave at once
        words = [str(pid()), str(os.getpid()), *(new_token() for _ in range(100))]
        os.write(write, " ".join(words).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        its_pid, its_getpid, *theirs = pipe.read().split()
    os.waitpid(child, 0)
    assert its_pid == its_getpid == str(child)
    assert len(theirs) == 100
    assert not set(theirs) & {*mine, *(new_token() for _ in range(100))}


def test_a_lazy_event_is_an_event() -> None:
    event = LazyEvent()
    assert isinstance(event, threading.Event)
    assert not event.is_set()
    assert event.wait(0.01) is False
    threading.Timer(0.05, event.set).start()
    started = time.monotonic()
    assert event.wait(5.0) is True
    assert time.monotonic() - started < 4.0
    assert event.is_set()
    assert event.wait() is True
    event.clear()
    assert not event.is_set()
    assert event.wait(0) is False


def test_a_lazy_event_wakes_every_waiter() -> None:
    event = LazyEvent()
    woken: list[bool] = []
    waiters = [threading.Thread(target=lambda: woken.append(event.wait(5.0))) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)
    event.set()
    for waiter in waiters:
        waiter.join(5.0)
    assert woken == [True] * 4


@pytest.mark.parametrize(
    ("retries", "delay", "wait"),
    [(False, 0.1, 0.0), (0, 0.1, False), (True, 0.1, 0.0), (0, True, 0.0)],
)
def test_memoised_acquire_checks_still_refuse_a_bool(
    redis_server: RedisServer, retries: object, delay: object, wait: object
) -> None:
    # A plain call's checked plan is kept per key: a bool equal to a default (False == 0,
    # False == 0.0) must not pass for it.
    sem = Semaphore(redis_server.url, limit=5)
    for _ in range(2):
        slot = sem.acquire("k")
        assert slot is not None
        slot.release()
    with pytest.raises(SemaphoreValidationError):
        sem.acquire("k", retries=retries, retry_delay=delay, wait=wait)  # type: ignore[arg-type]


def test_a_slot_due_before_the_renewers_plan_wakes_it(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=5, lease=60.0)
    with sem.hold("long", heartbeat=15.0) as long_slot:
        time.sleep(0.3)  # the renewer now sleeps until the long slot's tick, 15 s away
        with sem.hold("short", lease=0.6, heartbeat=0.15) as short:
            first = short.expires_at
            time.sleep(1.5)  # two and a half leases: only renewals keep it
            assert not short.lost.is_set()
            assert short.expires_at > first
        assert not long_slot.lost.is_set()


def _evalshas(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_park_makes_its_payload_only_when_it_is_to_park(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, lease=30.0, on_handoff=published)
    made: list[str] = []

    def payload(name: str) -> Callable[[], bytes]:
        def make() -> bytes:
            made.append(name)
            return name.encode()

        return make

    # Load the scripts, so that each call below is one EVALSHA.
    sem.room.park("warm", "w0", b"").release()  # type: ignore[union-attr]
    sem.room.park("warm", "w0", lambda: b"").release()  # type: ignore[union-attr]
    client.config_resetstat()
    first = sem.room.park("k", "w1", payload("w1"))  # a free slot and no room: no payload needed
    assert isinstance(first, Slot)
    assert (made, _evalshas(client)) == ([], 1)
    # Full, and no room this semaphore knows of: the take declines, then it parks with it.
    assert isinstance(sem.room.park("k", "w2", payload("w2")), Parked)
    assert (made, _evalshas(client)) == (["w2"], 3)
    # Now it knows the room: one round trip, with the payload.
    third = sem.room.park("k", "w3", payload("w3"))
    assert (third, made, _evalshas(client)) == (
        Parked(1, third.now_ms, 1), ["w2", "w3"], 4,  # type: ignore[union-attr]
    )  # fmt: skip
    # A semaphore (another process, say) that never saw the room queues behind it all the same.
    other = Semaphore(redis_server.url, limit=1, lease=30.0, on_handoff=published)
    assert isinstance(other.room.park("k", "w4", payload("w4")), Parked)
    assert made == ["w2", "w3", "w4"]
    assert [w.waiter for w in sem.room.waiters("k")] == ["w2", "w3", "w4"]
    for waiter in ("w2", "w3", "w4"):
        assert first.release()
        first = sem.room.claim("k", waiter)  # type: ignore[assignment]
        assert isinstance(first, Slot)
    assert published.waiters == ["w2", "w3", "w4"]
    assert first.release()
    sem.room.sweep("k")  # the empty room is deleted
    # The room is gone but still remembered: the park sends its payload, finds no room (and
    # forgets it); the next one takes its slot without a payload again.
    sem.room.park("k", "w5", payload("w5")).release()  # type: ignore[union-attr]
    sem.room.park("k", "w6", payload("w6")).release()  # type: ignore[union-attr]
    assert made == ["w2", "w3", "w4", "w5"]
