"""Several keys at once from asyncio code, on a real Redis: ``AsyncSemaphore.acquire_many``
takes every key in one script call or none, on the sync semaphore's keys, with weights and
per-call limits; the group is released together, renewed together by the loop's renewer, and
lost when any member is; a cancelled acquire leaves nothing held; bad arguments are refused
before anything is written.

Every wait here is on an event or a condition, with seconds of margin; the fixed sleeps are
the span a lease must survive, or the fault itself (a paused server), and say so.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from celery_semaphore import (
    Semaphore,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
)
from celery_semaphore.asyncio import AsyncSemaphore, AsyncSlotGroup
from celery_semaphore.testing import RedisServer

from .test_asyncio import run
from .test_asyncio_faults import _evalsha_calls, cancelled_while_frozen
from .test_asyncio_limits import refused_before_writing


def test_all_keys_or_none_in_one_call_on_the_sync_semaphores_keys(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sync = Semaphore(client, limit=1)

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            first = await sem.acquire_many([("provider", 3), ("tenant:a", 1)], metadata={"r": 1})
            assert isinstance(first, AsyncSlotGroup)
            assert first.keys == ["provider", "tenant:a"]
            assert [s.limit for s in first.slots] == [3, 1]
            assert first.key == "provider+tenant:a"
            calls = _evalsha_calls(client)
            assert await sem.acquire_many([("provider", 3), ("tenant:a", 1)]) is None
            assert _evalsha_calls(client) == calls + 1  # refused in one round trip
            assert await sem.count("provider") == 1  # the refused call took nothing
            # A sync holder of several keys counts against the same slots.
            other = await asyncio.to_thread(sync.acquire_many, [("provider", 3), ("tenant:b", 1)])
            assert other is not None
            assert await sem.acquire_many([("provider", 3), ("tenant:b", 1)]) is None
            assert await sem.count("provider") == 2
            # The group shows under every key it holds, with its metadata.
            [mine] = await sem.admin.holders("tenant:a")
            assert mine.token == first.token
            assert mine.metadata["r"] == 1
            assert first.token in {h.token for h in await sem.admin.holders("provider")}
            assert await first.release() is True
            assert await asyncio.to_thread(other.release)

    run(main)
    assert client.keys("semaphore:*") == []


def test_weights_count_per_key_and_a_misfit_takes_nothing(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            heavy = await sem.acquire_many([("pool", 6, 4), ("tenant:a", 3, 2)])
            assert heavy is not None
            assert [s.weight for s in heavy.slots] == [4, 2]
            assert (await sem.count("pool"), await sem.count("tenant:a")) == (4, 2)
            # 4 + 3 is above the pool's 6: the tenant's free units are not taken either.
            assert await sem.acquire_many([("pool", 6, 3), ("tenant:b", 3, 1)]) is None
            assert await sem.count("tenant:b") == 0
            fits = await sem.acquire_many([("pool", 6, 2), ("tenant:b", 3, 3)])
            assert fits is not None
            assert (await sem.count("pool"), await sem.count("tenant:b")) == (6, 3)
            assert await sem.available("pool", limit=6) == 0
            [record] = await sem.admin.holders("tenant:b")
            assert record.metadata["weight"] == 2  # the first key's weight, as the sync one
            async with fits:  # released on exit
                pass
            assert await sem.count("pool") == 4
            assert await heavy.release()

    run(main)
    assert client.keys("semaphore:*") == []


def test_a_live_limit_is_used_by_the_next_acquire_many(redis_server: RedisServer) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            assert await sem.admin.set_limit("tenant:a", 1) is None
            first = await sem.acquire_many([("provider", 5), ("tenant:a", 5)])
            assert first is not None
            assert [s.limit for s in first.slots] == [5, 1]  # the live limit won
            assert await sem.acquire_many([("provider", 5), ("tenant:a", 5)]) is None
            assert await sem.admin.set_limit("tenant:a", 2) == 1
            second = await sem.acquire_many([("provider", 5), ("tenant:a", 5)])
            assert second is not None
            assert await first.release()
            assert await second.release()

    run(main)


def test_release_frees_every_key_and_repeats_its_answer(redis_server: RedisServer) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=2) as sem:
            keys = [("a", 1), ("b", 1), ("c", 1)]
            group = await sem.acquire_many(keys)
            assert group is not None
            assert await sem.acquire_many(keys) is None
            assert await group.extend(10.0) is True
            assert all(s.lease == 10.0 for s in group.slots)
            assert await group.release() is True
            assert [await sem.count(k) for k, _ in keys] == [0, 0, 0]
            assert await group.release() is True  # the first answer, no new round trip
            assert not group.lost.is_set()
            again = await sem.acquire_many(keys)
            assert again is not None
            assert await again.release()

    run(main)


def test_hold_many_renews_every_key_and_a_force_released_one_loses_the_group(
    redis_server: RedisServer,
) -> None:
    sync = Semaphore(redis_server.url, limit=1)

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=1.5) as sem:
            lost: list[AsyncSlotGroup] = []
            with pytest.raises(SemaphoreLeaseLostError) as raised:
                async with sem.hold_many([("provider", 2), ("tenant:a", 1)],
                                         heartbeat=0.2) as group:  # fmt: skip
                    group.when_lost(lost.append)
                    await asyncio.sleep(3.5)  # more than two leases: renewal keeps both
                    assert not group.lost.is_set()
                    assert await asyncio.to_thread(sync.acquire, "tenant:a") is None
                    assert await asyncio.to_thread(sync.admin.force_release_all, "tenant:a") == 1
                    await asyncio.wait_for(group.lost.wait(), 20)
                    assert group.slots[1].lost.is_set()
                    assert not group.slots[0].lost.is_set()  # only its own verdict
            assert raised.value.key == "tenant:a"
            assert lost == [group]
            # Leaving the block gave back the provider's slot too.
            assert await sem.count("provider") == 0
            assert await sem.count("tenant:a") == 0

    run(main)


def test_hold_many_with_interrupt_cancels_the_body_when_a_key_is_lost(
    redis_server: RedisServer,
) -> None:
    sync = Semaphore(redis_server.url, limit=1)
    seen: list[str] = []

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            with pytest.raises(SemaphoreLeaseLostError):
                async with sem.hold_many([("a", 1), ("b", 1)], heartbeat=0.05, interrupt=True):
                    await asyncio.to_thread(sync.admin.force_release_all, "b")
                    try:
                        await asyncio.sleep(30)  # until the renewer sees the loss
                    except asyncio.CancelledError:
                        seen.append("cancelled")
                        raise
            assert await sem.count("a") == 0

    run(main)
    assert seen == ["cancelled"]


def test_hold_many_raises_when_some_key_has_no_room(redis_server: RedisServer) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            blocker = await sem.acquire("tenant:a")
            assert blocker is not None
            with pytest.raises(SemaphoreNotAcquiredError, match="not every key had room"):
                async with sem.hold_many([("provider", 2), ("tenant:a", 1)], retries=2,
                                         retry_delay=0.01):  # fmt: skip
                    pytest.fail("the body must not run")
            assert await sem.count("provider") == 0
            assert await blocker.release()

    run(main)


def test_an_acquire_many_cancelled_while_redis_is_frozen_leaves_no_slot_held(
    own_redis: RedisServer,
) -> None:
    # The script ran once Redis woke and took both keys; one release per key gave them
    # back, long before their 30 s lease: count, acquire_many, release, release.
    calls = cancelled_while_frozen(own_redis, lambda sem: sem.acquire_many([("a", 1), ("b", 1)]))
    assert calls == 4
    sync = Semaphore(own_redis.client(), limit=1)
    assert (sync.count("a"), sync.count("b")) == (0, 0)
    sync.client.close()


def test_aclose_gives_back_a_group_still_held_and_marks_it_lost(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    async def main() -> None:
        sem = AsyncSemaphore(redis_server.url, limit=1)
        group = await sem.acquire_many([("a", 1), ("b", 1)])
        assert group is not None
        returned = await sem.aclose()
        assert {s.key for s in returned} == {"a", "b"}
        assert group.lost.is_set()

    run(main)
    assert client.keys("semaphore:*") == []


@pytest.mark.parametrize(
    "call",
    [
        lambda sem: sem.acquire_many([]),
        lambda sem: sem.acquire_many([("a", 1), ("a", 2)]),
        lambda sem: sem.acquire_many([("a", 0)]),
        lambda sem: sem.acquire_many([("a",)]),
        lambda sem: sem.acquire_many("a"),
        lambda sem: sem.acquire_many([("a", 2, 3)]),
        lambda sem: sem.acquire_many([("a", 2, 0)]),
        lambda sem: sem.acquire_many([("", 1)]),
        lambda sem: sem.acquire_many([["a", 1]]),
        lambda sem: sem.acquire_many([("a", 1)], lease=0),
        lambda sem: sem.acquire_many([("a", 1)], retries=-1),
        lambda sem: sem.acquire_many([("a", 1)], metadata={"x": object()}),
        lambda sem: sem.hold_many([("a", 1), ("a", 1)]).__aenter__(),
        lambda sem: sem.hold_many([("a", 1)], lease=1.0, heartbeat=0.9).__aenter__(),
        lambda sem: sem.hold_many([("a", 1)], interrupt="yes").__aenter__(),
        lambda sem: sem.hold_many([("a", 1)], on_renew_error=1).__aenter__(),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    redis_server: RedisServer, client: redis.Redis, call: Any
) -> None:
    refused_before_writing(redis_server, client, call)


def test_a_group_is_renewed_in_one_round_trip_per_tick(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    async def main() -> int:
        async with (
            AsyncSemaphore(redis_server.url, limit=1, lease=2.0) as sem,
            sem.hold_many([("a", 1), ("b", 1), ("c", 1)], heartbeat=0.25),
        ):
            before = _evalsha_calls(client)
            await asyncio.sleep(1.6)  # the span measured: about six ticks
            return _evalsha_calls(client) - before

    calls = run(main)
    # One extend per tick renews all three keys; per key it would be three times as many.
    assert 1 <= calls <= 9
