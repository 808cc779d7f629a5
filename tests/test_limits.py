"""Limits as data, on a real Redis: a per-call limit, and a live limit stored in Redis that
wins over the callers' until it is cleared (raised, it starts parked waiters and wakes
waiting callers at once; lowered, it evicts nobody)."""

from __future__ import annotations

import asyncio
import enum
import re
import threading
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from celery_semaphore import Semaphore, SemaphoreValidationError, Slot
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.core.names import redis_keys
from celery_semaphore.testing import RedisServer
from celery_semaphore.views.cli import render, semaphore
from celery_semaphore.views.inspection import views

from .celery_apps import make_app
from .helpers import Published, wait_for


def test_a_live_limit_wins_over_the_callers_and_lowering_it_evicts_nobody(
    make_semaphore: Any, client: redis.Redis
) -> None:
    sem: Semaphore = make_semaphore(limit=2, lease=30.0)
    held = [sem.acquire("k"), sem.acquire("k")]
    assert sem.acquire("k") is None
    assert sem.admin.set_limit("k", 3, by="ops") is None
    third = sem.acquire("k")
    assert third is not None
    assert third.limit == 3
    live = sem.admin.live_limit("k")
    assert live is not None
    assert (live.limit, live.by) == (3, "ops")
    # Lowered below what is held: every holder keeps its slot, nobody new gets in.
    assert sem.admin.set_limit("k", 1) == 3
    assert sem.count("k") == 3
    assert sem.acquire("k", limit=10) is None  # the live limit wins over a caller's too
    assert all(s is not None and s.extend() for s in [*held, third])
    for slot in [*held, third]:
        assert slot is not None
        assert slot.release()
    assert sem.acquire("k") is not None
    assert sem.acquire("k") is None  # 1 of 1
    # Cleared: the callers' own limits apply again.
    assert sem.admin.set_limit("k", None) == 1
    assert sem.admin.live_limit("k") is None
    assert sem.available("k") == 1
    assert sem.acquire("k") is not None
    assert client.ttl(redis_keys(sem.prefix, "k").limits) == -2  # gone with the clear


def test_a_per_call_limit_counts_against_the_same_slots(make_semaphore: Any) -> None:
    sem: Semaphore = make_semaphore(limit=1)
    slots = [sem.acquire("k", limit=3) for _ in range(4)]
    assert [s is not None for s in slots] == [True, True, True, False]
    assert {s.limit for s in slots if s is not None} == {3}
    assert sem.acquire("k") is None  # the semaphore's own limit, 1, is full too
    assert sem.available("k", limit=5) == 2
    for s in slots:
        if s is not None:
            s.release()


def test_raising_a_live_limit_hands_freed_slots_to_parked_waiters_in_the_same_call(
    redis_server: RedisServer,
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    holder = sem.acquire("k")
    for waiter in ("w1", "w2", "w3"):
        sem.room.park("k", waiter, waiter.encode())
    assert published.waiters == []
    sem.admin.set_limit("k", 3)
    assert published.waiters == ["w1", "w2"]  # the oldest two, at once
    assert sem.count("k") == 3  # the holder and two reservations
    assert [w.waiter for w in sem.room.waiters("k")] == ["w3"]
    # A release hands out by the live limit too: the freed slot goes to w3.
    assert holder is not None
    assert holder.release()
    assert published.waiters == ["w1", "w2", "w3"]


def test_raising_a_live_limit_wakes_a_caller_waiting_for_a_slot(make_semaphore: Any) -> None:
    sem: Semaphore = make_semaphore(limit=1)
    holder = sem.acquire("k")
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(sem.acquire("k", wait=30.0)))
    waiter.start()
    blocked = redis_keys(sem.prefix, "k").blocked
    assert wait_for(lambda: sem.client.zcard(blocked) == 1, timeout=10)
    sem.admin.set_limit("k", 2)
    waiter.join(timeout=20)  # the wait is 30 s: a slot well before it came from the wake-up
    assert not waiter.is_alive()
    assert got
    assert got[0] is not None
    assert got[0].limit == 2
    got[0].release()
    assert holder is not None
    assert holder.release()


def test_a_weight_above_a_lowered_live_limit_is_refused_and_a_raise_wakes_its_waiter(
    make_semaphore: Any,
) -> None:
    """The model test found it: with nobody holding the key, a weight that no longer fits
    its live limit got a reply with no soonest expiry, which the client could not read."""
    sem: Semaphore = make_semaphore(limit=3)
    sem.admin.set_limit("k", 1)
    assert sem.acquire("k", weight=2) is None
    assert sem.acquire_many([("k", 3, 2), ("other", 3)]) is None
    assert sem.count("other") == 0  # all or nothing
    sem.client.config_resetstat()
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(sem.acquire("k", weight=2, wait=30.0)))
    waiter.start()
    blocked = redis_keys(sem.prefix, "k").blocked
    assert wait_for(lambda: sem.client.zcard(blocked) == 1, timeout=10)
    sem.admin.set_limit("k", 2)  # room for the weight: the waiter wakes and takes it
    waiter.join(timeout=20)
    assert not waiter.is_alive()
    assert got[0] is not None
    assert got[0].weight == 2
    # It blocked on its wake-up until the raise; no loop of asks while nothing could lapse.
    calls = sum(v["calls"] for k, v in sem.client.info("commandstats").items() if "eval" in k)
    assert calls < 10, calls
    assert got[0].release()


@pytest.mark.parametrize(
    "call",
    [
        lambda sem: sem.acquire("k", limit=0),
        lambda sem: sem.acquire("k", limit="2"),
        lambda sem: sem.acquire("k", limit=True),
        lambda sem: sem.hold("k", limit=2**31).__enter__(),
        lambda sem: sem.room.park("k", "w", b"", limit=-1),
        lambda sem: sem.admin.set_limit("k", 0),
        lambda sem: sem.admin.set_limit("k", 2.5),
        lambda sem: sem.admin.set_limit("", 2),
        lambda sem: sem.admin.set_limit("k", 2, by=""),
        lambda sem: sem.admin.live_limit(""),
    ],
)
def test_bad_limits_are_refused_before_anything_is_written(
    make_semaphore: Any, client: redis.Redis, call: Any
) -> None:
    sem: Semaphore = make_semaphore(limit=1)
    with pytest.raises(SemaphoreValidationError):
        call(sem)
    assert client.dbsize() == 0


def test_the_async_semaphore_takes_per_call_and_live_limits(redis_server: RedisServer) -> None:
    async def scenario() -> list[int]:
        sem = AsyncSemaphore(redis_server.url, limit=1)
        try:
            first = await sem.acquire("k", limit=2)
            second = await sem.acquire("k", limit=2)
            refused = await sem.acquire("k", limit=2)
            Semaphore(redis_server.url, limit=1).admin.set_limit("k", 3)
            third = await sem.acquire("k")
            assert refused is None
            assert first
            assert second
            assert third
            return [s.limit for s in (first, second, third)]
        finally:
            await sem.aclose()

    assert asyncio.run(scenario()) == [2, 2, 3]


def test_set_limit_and_status_from_the_command_line(redis_server: RedisServer) -> None:
    app = make_app(redis_server.url)
    app.conf.semaphores = {"openai": {"limit": 20}, "tenant:{tenant_id}": {"limit": 2}}
    cli = CliRunner()

    def run(*args: str) -> Any:
        return cli.invoke(semaphore, list(args), obj=type("Ctx", (), {"app": app})())

    idle = run("status")
    assert idle.exit_code == 0, idle.output
    assert "openai  no slot held, limit 20" in idle.output  # declared, listed while idle
    assert "tenant:" not in idle.output  # a template names no key
    done = run("set-limit", "openai", "30")
    assert done.exit_code == 0, done.output
    assert "Live limit of 'openai' set to 30 (was none)." in done.output
    status = run("status", "openai")
    assert "openai  no slot held, limit 30 (live limit 30, set by " in status.output
    # When: ISO 8601 with the UTC offset, so operators in several time zones agree.
    assert re.search(r" at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d\)", status.output), (
        status.output
    )
    [shown] = views(redis.Redis.from_url(redis_server.url), ["openai"])
    assert shown.live is not None
    assert " pid " in shown.live.by
    assert shown.as_dict()["live_limit"]["limit"] == 30
    assert "live limit 30" in render([shown])
    assert "(was 30)" in run("set-limit", "openai", "--clear").output
    for bad in (["set-limit", "openai"], ["set-limit", "openai", "0"],
                ["set-limit", "openai", "5", "--clear"]):  # fmt: skip
        assert run(*bad).exit_code == 2, bad
    # Only the decisions hash stays, with the clear in it (a copy older than it is never
    # put back after a restart of the store).
    assert redis.Redis.from_url(redis_server.url).keys("semaphore:*") == [b"semaphore:decisions"]
    app.close()


def test_an_int_subclass_limit_is_sent_as_a_number(make_semaphore: Any) -> None:
    class Plan(enum.IntEnum):
        TEAM = 4

    sem: Semaphore = make_semaphore(limit=Plan.TEAM)
    first = sem.acquire("k", limit=Plan.TEAM, weight=Plan.TEAM)
    assert first is not None
    assert first.limit == 4
    sem.admin.set_limit("k", Plan.TEAM)
    live = sem.admin.live_limit("k")
    assert live is not None
    assert live.limit == 4


def test_the_room_follows_the_limit_its_latest_caller_gave(
    make_semaphore: Any, client: redis.Redis
) -> None:
    """A limit computed per run may change: each park and claim brings the room's up to date,
    so later hand-offs follow it (a lowered one evicts nobody)."""
    sem: Semaphore = make_semaphore(limit=1, on_handoff=lambda key, handoffs: None)
    parked = redis_keys(sem.prefix, "k").parked
    held = [sem.acquire("k", limit=4) for _ in range(4)]
    for n in range(1, 4):
        sem.room.park("k", f"w{n}", b"", limit=4)
    assert client.hget(parked, "!limit") == b"4"
    assert held[0] is not None
    held[0].release()  # hands the slot to w1
    claimed = sem.room.claim("k", "w1", limit=2)  # w1's run computes 2 now
    assert isinstance(claimed, Slot)
    assert client.hget(parked, "!limit") == b"2"
    assert held[1] is not None
    held[1].release()
    assert sem.count("k") == 3  # nobody evicted, and no hand-off while 3 of 2 are held
    assert [w.waiter for w in sem.room.waiters("k")] == ["w2", "w3"]
