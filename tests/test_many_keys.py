"""Several keys per run on a real Redis: all taken in one call or none; a waiting run keeps a
key only while nothing but capacity stands in its way elsewhere; Celery tasks
bounded at two levels at once stay under both, judged from the bodies' own records; on Redis
Cluster the keys must share a hash tag."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import (
    Semaphore,
    SemaphoreTask,
    SemaphoreValidationError,
    current_slot,
)
from celery_semaphore.core.group import SlotGroup
from celery_semaphore.core.names import redis_keys
from celery_semaphore.core.replies import Parked
from celery_semaphore.testing import RedisServer

from . import history
from .helpers import Published
from .history import BODIES, History
from .servers import ClusterServers

TENANTS = ("a", "b", "c", "d")


def test_all_keys_or_none_in_one_call(make_semaphore: Any, client: redis.Redis) -> None:
    sem: Semaphore = make_semaphore(limit=1)
    first = sem.acquire_many([("provider", 3), ("tenant:a", 1)])
    assert isinstance(first, SlotGroup)
    assert [s.limit for s in first.slots] == [3, 1]
    commands = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert sem.acquire_many([("provider", 3), ("tenant:a", 1)]) is None
    assert client.info("commandstats")["cmdstat_evalsha"]["calls"] == commands + 1
    assert sem.count("provider") == 1  # the refused run took nothing
    second = sem.acquire_many([("provider", 3), ("tenant:b", 1)])
    assert second is not None
    assert sem.count("provider") == 2
    # A run shows under every key it holds.
    assert [h.token for h in sem.admin.holders("tenant:a")] == [first.token]
    assert first.token in {h.token for h in sem.admin.holders("provider")}
    assert first.release()
    assert second.release()
    assert client.keys("semaphore:*") == []


@pytest.mark.parametrize(
    "keys",
    [[], [("a", 1), ("a", 2)], [("a", 0)], [("a",)], "a", [("a", 2, 3)], [("", 1)]],
)
def test_bad_key_lists_are_refused_before_anything_is_written(
    make_semaphore: Any, client: redis.Redis, keys: Any
) -> None:
    sem: Semaphore = make_semaphore(limit=1)
    with pytest.raises(SemaphoreValidationError):
        sem.acquire_many(keys)
    with pytest.raises(SemaphoreValidationError):
        sem.room.park_many(keys, "w", b"")
    assert client.dbsize() == 0


def test_a_waiting_run_keeps_a_key_only_once_nothing_but_capacity_is_in_its_way(
    redis_server: RedisServer,
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    a_keys, c_keys = [("provider", 2), ("tenant:a", 1)], [("provider", 2), ("tenant:c", 1)]
    first = sem.room.park_many(a_keys, "r1", b"1")
    assert isinstance(first, SlotGroup)
    waiting = sem.room.park_many(a_keys, "r2", b"2")  # tenant:a is full
    assert isinstance(waiting, Parked)
    assert waiting.index == 2
    # It gave back the provider's unit: kept, it would idle while tenant:a is busy.
    assert sem.count("provider") == 1
    other = sem.room.park_many([("provider", 2), ("tenant:b", 1)], "r3", b"3")
    assert isinstance(other, SlotGroup)
    blocked = sem.room.park_many(c_keys, "r4", b"4")  # the provider is full now
    assert isinstance(blocked, Parked)
    assert blocked.index == 1
    assert sem.count("tenant:c") == 0
    assert first.release()  # provider -> r4 (tenant:c is free); tenant:a -> r2, kept
    assert published.waiters == ["r4"]  # r2 is handed off only once it holds both
    assert sem.count("tenant:a") == 1
    [kept] = sem.admin.holders("tenant:a")
    assert kept.metadata["reserved_for"] == "r2"
    assert kept.metadata["waiting"] is True
    assert [w.waiter for w in sem.room.waiters("provider")] == ["r2"]  # next there
    started = sem.room.claim_many(c_keys, "r4")
    assert isinstance(started, SlotGroup)
    assert started.release()  # the provider's unit goes to r2, which now holds both
    assert published.waiters == ["r4", "r2"]
    again = sem.room.claim_many(a_keys, "r2")
    assert isinstance(again, SlotGroup)
    assert again.release()
    assert other.release()
    assert [sem.count(k) for k in ("provider", "tenant:a", "tenant:b", "tenant:c")] == [0] * 4


@pytest.mark.parametrize("on_full", ["queue", "retry"])
def test_tasks_bounded_at_two_levels_stay_under_both(
    redis_server: RedisServer, client: redis.Redis, app: Celery, on_full: str
) -> None:
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore=[("provider", 3), ("tenant:{tenant}", 1)],
              on_full=on_full, shared=False, name="many.call")  # fmt: skip
    def call(tenant: str, n: int) -> list[str]:
        slot = current_slot()
        assert isinstance(slot, SlotGroup)
        with (
            history.run(recorder, BODIES, "provider", data={"n": n}),
            history.run(recorder, BODIES, f"tenant:{tenant}", data={"n": n}),
        ):
            time.sleep(0.05)
        return slot.keys

    with start_worker(app, pool="threads", concurrency=8, perform_ping_check=False):
        results = [call.delay(t, n) for n in range(4) for t in TENANTS]
        keys = [r.get(timeout=120) for r in results]
    assert keys[0] == ["provider", "tenant:a"]
    limits = {"provider": 3, **{f"tenant:{t}": 1 for t in TENANTS}}
    runs = History.load(client, BODIES)
    report = runs.of("provider").assert_ok({"provider": 3}, tasks=[r.id for r in results])
    assert report.peaks["provider"] == 3  # four tenants keep the provider busy
    for tenant in TENANTS:
        runs.of(f"tenant:{tenant}").assert_ok({f"tenant:{tenant}": limits[f"tenant:{tenant}"]})
    sem = Semaphore(redis_server.url, limit=1)
    assert [sem.count(k) for k in limits] == [0] * len(limits)
    # Outside a worker, the run waits for both keys, then runs.
    assert call.apply(args=("a", 99)).get() == ["provider", "tenant:a"]
    recorder.close()


def test_a_task_gives_each_key_its_limit_in_the_list(app: Celery) -> None:
    with pytest.raises(SemaphoreValidationError, match="give no limit="):

        @app.task(base=SemaphoreTask, semaphore=[("a", 1)], limit=2, shared=False, name="m.x")
        def x() -> None: ...

        app.finalize()


def test_on_a_cluster_the_keys_must_share_a_hash_tag(cluster: ClusterServers) -> None:
    sem = Semaphore(cluster.url, limit=1)
    with pytest.raises(SemaphoreValidationError, match="different Redis Cluster shards"):
        sem.acquire_many([("openai", 20), ("tenant:acme", 2)])
    group = sem.acquire_many([("{llm}openai", 20), ("{llm}tenant:acme", 2)])
    assert group is not None
    assert sem.count("{llm}openai") == 1
    assert group.release()
    parked = sem.room.park_many([("{llm}openai", 20), ("{llm}tenant:acme", 2)], "w", b"")
    assert isinstance(parked, SlotGroup)
    assert parked.release()
    sem.client.close()


def test_a_coroutine_function_takes_one_key() -> None:
    from celery_semaphore import bounded

    with pytest.raises(SemaphoreValidationError, match="on a coroutine function give one key"):

        @bounded([("a", 1), ("b", 1)], redis="redis://127.0.0.1:1/0")
        async def call() -> None: ...


def test_weighted_runs_of_several_keys_never_sum_above_any_limit(
    redis_server: RedisServer, client: redis.Redis, app: Celery
) -> None:
    """Each run takes ``w`` units of a shared pool and of its tenant's key at once; at no
    moment do the weights in flight exceed either limit, by the bodies' own records."""
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore=[("pool", 6), ("tenant:{tenant}", 3)],
              weight=lambda tenant, n, w: w, shared=False, name="many.weighted")  # fmt: skip
    def weighted(tenant: str, n: int, w: int) -> int:
        with (
            history.run(recorder, BODIES, "pool", weight=w),
            history.run(recorder, BODIES, f"tenant:{tenant}", weight=w),
        ):
            time.sleep(0.03)
        return w

    plan = [(t, n, (n * 7 + i) % 3 + 1) for n in range(6) for i, t in enumerate(TENANTS)]
    with start_worker(app, pool="threads", concurrency=8, perform_ping_check=False):
        results = [weighted.delay(*args) for args in plan]
        assert [r.get(timeout=120) for r in results] == [w for _, _, w in plan]
    runs = History.load(client, BODIES)
    report = runs.of("pool").assert_ok({"pool": 6}, tasks=[r.id for r in results])
    assert report.peaks["pool"] >= 4  # the pool was shared, not run one at a time
    for tenant in TENANTS:
        runs.of(f"tenant:{tenant}").assert_ok({f"tenant:{tenant}": 3})
    recorder.close()


def test_live_limits_and_weights_on_a_cluster(cluster: ClusterServers) -> None:
    sem = Semaphore(cluster.url, limit=4)
    heavy = sem.acquire("{gpu}node-1", weight=3)
    assert heavy is not None
    assert sem.acquire("{gpu}node-1", weight=2) is None
    sem.admin.set_limit("{gpu}node-1", 5)
    light = sem.acquire("{gpu}node-1", weight=2)
    assert light is not None
    assert light.limit == 5
    assert sem.count("{gpu}node-1") == 5
    live = sem.admin.live_limit("{gpu}node-1")
    assert live is not None
    assert live.limit == 5
    assert heavy.release()
    assert light.release()
    assert sem.admin.set_limit("{gpu}node-1", None) == 5
    sem.client.close()


def test_a_run_that_moves_rooms_keeps_its_give_up_time(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    keys = [("provider", 1), ("tenant:a", 1)]
    tenant = sem.acquire("tenant:a")
    deadline = time.time() + 600
    parked = sem.room.park_many(keys, "r1", b"1", deadline=deadline)
    assert isinstance(parked, Parked)
    assert parked.index == 2
    provider = sem.acquire("provider")  # now the provider blocks r1 too
    assert tenant is not None
    assert tenant.release()  # tenant:a hands its slot to r1
    moved = sem.room.claim_many(keys, "r1")
    assert isinstance(moved, Parked)
    assert moved.index == 1
    give_up = client.zscore(redis_keys(sem.prefix, "provider").deadlines, "r1")
    assert give_up == round(deadline * 1000)
    assert provider is not None
    assert provider.release()


def test_fair_turns_and_a_raised_live_limit_hand_off_on_a_cluster(cluster: ClusterServers) -> None:
    """A raise on a cluster hands the freed slots out in the same call, by fair turns."""
    published = Published()
    sem = Semaphore(cluster.url, limit=1, on_handoff=published)
    held = sem.acquire("{llm}openai")
    assert held is not None
    for n in range(3):
        assert isinstance(sem.room.park("{llm}openai", f"a-{n}", b"", tenant="tenant:a"), Parked)
    assert isinstance(sem.room.park("{llm}openai", "b-0", b"", tenant="tenant:b"), Parked)
    sem.admin.set_limit("{llm}openai", 3)  # two slots freed: the head, then the other tenant's turn
    assert published.waiters == ["a-0", "b-0"]
    assert [w.waiter for w in sem.room.waiters("{llm}openai")] == ["a-1", "a-2"]
    assert held.release()
    assert published.waiters == ["a-0", "b-0", "a-1"]
    sem.admin.set_limit("{llm}openai", None)
    sem.client.close()
