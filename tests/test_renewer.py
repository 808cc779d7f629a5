"""One renewer per process: every held slot renewed in one round trip per tick, each slot
still judged lost on its own."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time

import redis

from celery_semaphore import Semaphore, SemaphoreLeaseLostError, Slot
from celery_semaphore.core import heartbeat
from celery_semaphore.testing import RedisServer

from .helpers import wait_for


def _extend_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_200_slots_share_one_renewer_and_only_the_force_released_one_is_lost(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sem = Semaphore(redis_server.url, limit=200, lease=2.0)
    # A sender left behind by an earlier test's hung round trip ends when that returns.
    before = {t.ident for t in heartbeat.threads() if t.name != "semaphore-renewer"}
    with contextlib.ExitStack() as stack:
        slots: list[Slot] = [stack.enter_context(sem.hold("k", heartbeat=0.5)) for _ in range(200)]
        client.config_resetstat()
        time.sleep(2.5)  # five renewal intervals, past the first lease: the point of the test
        calls = _extend_calls(client)
        names = [t.name for t in heartbeat.threads() if t.ident not in before]
        assert names.count("semaphore-renewer") == 1
        assert len(names) <= 2  # the renewer and the thread that sends its round trips
        # One call per tick (about five here) instead of one per slot per tick (about 1,000).
        assert calls <= 25, f"{calls} EVALSHA calls for 200 slots over 2.5 s"
        assert not any(s.lost.is_set() for s in slots)
        victim = slots[57]
        assert sem.admin.force_release("k", victim.token)
        assert victim.lost.wait(10)
        assert "gone" in str(victim.lease_lost_error())
        time.sleep(1.0)  # two more ticks: nobody else may be reported lost
        assert [i for i, s in enumerate(slots) if s.lost.is_set()] == [57]
        with contextlib.suppress(SemaphoreLeaseLostError):
            stack.close()
    assert sem.count("k") == 0
    assert wait_for(lambda: heartbeat.threads() == [], timeout=10)


def _hold_in_child(url: str, queue: multiprocessing.Queue[str]) -> None:  # type: ignore[type-arg]
    sem = Semaphore(url, limit=2, lease=0.6)
    try:
        with sem.hold("forked", heartbeat=0.15) as slot:
            time.sleep(1.5)  # more than two leases: only a renewer in this process keeps it
            queue.put("lost" if slot.lost.is_set() else f"held {os.getpid()}")
    except SemaphoreLeaseLostError:
        queue.put("lost")


def test_a_forked_child_starts_its_own_renewer(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=2, lease=0.6)
    ctx = multiprocessing.get_context("fork")
    results: multiprocessing.Queue[str] = ctx.Queue()  # type: ignore[type-arg]
    with sem.hold("forked", heartbeat=0.15) as slot:  # the parent's renewer is running
        child = ctx.Process(target=_hold_in_child, args=(redis_server.url, results))
        child.start()
        answer = results.get(timeout=30)
        child.join(30)
        assert answer.startswith("held"), answer
        assert not slot.lost.is_set()
