"""The asyncio semaphore against a real redis-server: the same slots as the sync one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import redis
from redis import asyncio as aioredis

from celery_semaphore import (
    Semaphore,
    SemaphoreBackendError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from celery_semaphore.asyncio import AsyncSemaphore, AsyncSlot, async_client_like
from celery_semaphore.core.names import redis_keys
from celery_semaphore.testing import RedisServer

from . import history

T = TypeVar("T")


def run(make: Callable[[], Awaitable[T]]) -> T:
    """Run ``make()`` in a fresh event loop, as a plain test does."""

    async def main() -> T:
        return await make()

    return asyncio.run(main())


async def close(client: aioredis.Redis) -> None:
    """Close an asyncio client: ``aclose()`` from redis-py 5.0.1, ``close()`` before."""
    closer = getattr(client, "aclose", None)
    await (closer() if closer is not None else client.close())


def _blocked(client: redis.Redis, key: str = "k") -> int:
    return int(client.zcard(redis_keys("semaphore", key).blocked))


def test_25_coroutines_on_limit_20_get_exactly_20_slots(redis_server: RedisServer) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=20) as sem:
            results = await asyncio.gather(*(sem.acquire("openai") for _ in range(25)))
            slots = [s for s in results if s is not None]
            assert len(slots) == 20
            assert results.count(None) == 5
            assert await sem.count("openai") == 20
            assert await sem.available("openai") == 0
            assert len({s.token for s in slots}) == 20
            assert all(await asyncio.gather(*(s.release() for s in slots)))
            assert await sem.count("openai") == 0

    run(main)


def test_sync_and_async_holders_count_against_one_key(redis_server: RedisServer) -> None:
    sync = Semaphore(redis_server.url, limit=3)
    held = [sync.acquire("shared"), sync.acquire("shared")]

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=3) as sem:
            slot = await sem.acquire("shared", metadata={"request": "r1"})
            assert slot is not None
            assert await sem.acquire("shared") is None  # two sync holders and this one
            assert sync.acquire("shared") is None
            assert sync.count("shared") == 3
            mine = [h for h in sync.admin.holders("shared") if h.token == slot.token]
            assert mine[0].metadata["request"] == "r1"
            assert mine[0].metadata["limit"] == 3
            for other in held:
                assert other is not None
                other.release()
            assert await sem.count("shared") == 1
            assert await slot.release() is True

    run(main)
    assert sync.count("shared") == 0


def test_hold_keeps_its_slot_through_a_body_three_times_the_lease(
    redis_server: RedisServer,
) -> None:
    sync = Semaphore(redis_server.url, limit=1, lease=1.0)

    async def main() -> AsyncSlot:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=1.0) as sem:
            intruders = []
            async with sem.hold("long") as slot:
                end = time.monotonic() + 3.0
                while time.monotonic() < end:
                    other = await asyncio.to_thread(sync.acquire, "long")
                    if other is not None:
                        intruders.append(other)
                    await asyncio.sleep(0.1)
                    assert not slot.lost.is_set()
            assert intruders == []
            assert await sem.count("long") == 0
            return slot

    assert not run(main).lost.is_set()


def test_run_returns_the_body_result_and_passes_the_slot(redis_server: RedisServer) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=2) as sem:

            async def body(slot: AsyncSlot) -> tuple[str, int, int]:
                return slot.key, slot.limit, await sem.count("k")

            assert await sem.run("k", body) == ("k", 2, 1)
            assert await sem.count("k") == 0
            with pytest.raises(RuntimeError):
                async with sem.hold("k"):
                    raise RuntimeError("the body's own failure")
            assert await sem.count("k") == 0

    run(main)


def test_extend_release_and_context_manager(redis_server: RedisServer) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=5.0) as sem:
            slot = await sem.acquire("k")
            assert slot is not None
            before = slot.expires_at
            assert await slot.extend(lease=10.0) is True
            assert slot.lease == 10.0
            assert slot.expires_at > before
            async with slot:
                assert await sem.count("k") == 1
            assert await sem.count("k") == 0
            assert await slot.release() is True  # the first answer, no new round trip
            assert await slot.extend() is False
            assert not slot.lost.is_set()

    run(main)


def test_release_after_the_lease_lapsed_reports_false_and_marks_lost(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=0.2) as sem:
            slot = await sem.acquire("k")
            assert slot is not None
            other = await sem.acquire("k", retries=200, retry_delay=0.01)  # after the lapse
            assert other is not None
            assert await slot.extend() is False
            assert slot.lost.is_set()
            assert await slot.release() is False
            assert "gone" in str(slot.lease_lost_error())
            assert await other.release() is True

    run(main)


def test_without_heartbeat_a_long_body_loses_its_lease(redis_server: RedisServer) -> None:
    async def main() -> AsyncSlot:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=0.5) as sem:
            with pytest.raises(SemaphoreLeaseLostError) as info:
                async with sem.hold("k", heartbeat=False) as slot:
                    await asyncio.sleep(0.8)
            assert info.value.key == "k"
            return slot

    assert run(main).lost.is_set()


def test_a_blocked_body_is_judged_at_the_end_by_its_deadline(redis_server: RedisServer) -> None:
    # A body that blocks the event loop starves the renewer; the check when it ends still
    # finds that a whole lease passed with no renewal.
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=0.5) as sem:
            with pytest.raises(SemaphoreLeaseLostError, match="within one lease"):
                async with sem.hold("k", heartbeat=0.1):
                    time.sleep(1.0)  # the fault: no await for two leases

    run(main)


def test_a_release_wakes_blocked_callers_of_either_kind(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sync = Semaphore(redis_server.url, limit=1, lease=30.0)
    holder = sync.acquire("k")
    assert holder is not None

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=30.0) as sem:
            started = time.monotonic()
            waiting = asyncio.ensure_future(sem.acquire("k", wait=60.0))
            while _blocked(client) < 1:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(holder.release)  # a sync release wakes the coroutine
            slot = await asyncio.wait_for(waiting, 30)
            assert slot is not None
            assert time.monotonic() - started < 20  # woken, not the 30 s lease or 60 s budget
            assert _blocked(client) == 0
            # ... and an async release wakes a sync caller blocked in a thread.
            got: list[Any] = []
            thread = threading.Thread(target=lambda: got.append(sync.acquire("k", wait=60.0)))
            thread.start()
            while _blocked(client) < 1:
                await asyncio.sleep(0.02)
            assert await slot.release() is True
            await asyncio.to_thread(thread.join, 30)
            assert got
            assert got[0] is not None
            got[0].release()

    run(main)


def test_a_caller_never_woken_gives_up_after_its_wait(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sync = Semaphore(redis_server.url, limit=1)
    holder = sync.acquire("k")
    assert holder is not None

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            started = time.monotonic()
            assert await sem.acquire("k", wait=0.5) is None
            assert time.monotonic() - started >= 0.5
            with pytest.raises(SemaphoreNotAcquiredError):
                async with sem.hold("k", wait=0.2):
                    pytest.fail("body must not run")

    run(main)
    assert _blocked(client) == 0
    holder.release()
    for name in redis_keys("semaphore", "k"):  # nothing left without a TTL
        assert client.pttl(name) != -1, name


UNREACHABLE = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize(
    "options",
    [
        {"lease": 0},
        {"lease": float("inf")},
        {"retries": -1},
        {"retry_delay": float("nan")},
        {"wait": -1.0},
        {"wait": 1.0, "retries": 2},
        {"metadata": ["not", "a", "mapping"]},
        {"metadata": {"bad": object()}},
    ],
)
def test_bad_acquire_arguments_are_refused_before_redis(options: dict[str, Any]) -> None:
    # Nothing answers at UNREACHABLE: a validation error proves nothing was sent.
    async def main() -> None:
        sem = AsyncSemaphore(UNREACHABLE, limit=1)
        with pytest.raises(SemaphoreValidationError):
            await sem.acquire("k", **options)
        await sem.aclose()

    run(main)


@pytest.mark.parametrize(
    "options",
    [
        {"heartbeat": 1.0, "lease": 1.0},
        {"heartbeat": -1},
        {"on_renew_error": "not callable"},
        {"interrupt": "yes"},
    ],
)
def test_bad_hold_arguments_are_refused_before_redis(options: dict[str, Any]) -> None:
    async def main() -> None:
        sem = AsyncSemaphore(UNREACHABLE, limit=1)
        with pytest.raises(SemaphoreValidationError):
            async with sem.hold("k", **options):
                pytest.fail("body must not run")
        with pytest.raises(SemaphoreValidationError):
            await sem.count("")
        await sem.aclose()

    run(main)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((UNREACHABLE, 0), {}),
        ((UNREACHABLE, 1), {"lease": -1}),
        ((UNREACHABLE, 1), {"prefix": "a{b"}),
        ((UNREACHABLE, 1), {"claim_timeout": 0}),
        ((redis.Redis(), 1), {}),  # a sync client is not an asyncio one
        ((42, 1), {}),
    ],
)
def test_bad_constructor_arguments_are_refused(args: tuple[Any, ...], kwargs: Any) -> None:
    with pytest.raises(SemaphoreValidationError):
        AsyncSemaphore(*args, **kwargs)


@pytest.mark.parametrize("options", [{"protocol": 3}, {"decode_responses": True}])
def test_resp3_and_decoding_clients(redis_server: RedisServer, options: dict[str, Any]) -> None:
    async def main() -> None:
        client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, **options)
        sem = AsyncSemaphore(client, limit=1, lease=5.0)
        slot = await sem.acquire("k", metadata={"n": 1})
        assert slot is not None
        assert await sem.acquire("k") is None
        assert (await sem.admin.holders("k"))[0].metadata["n"] == 1
        assert await slot.extend() is True
        assert await slot.release() is True
        assert await sem.admin.force_release_all("k") == 0
        await close(client)

    run(main)


def test_a_twin_of_a_sync_client_reaches_the_same_server(redis_server: RedisServer) -> None:
    sync_client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=3)
    Semaphore(sync_client, limit=1).acquire("twin")

    async def main() -> None:
        twin = async_client_like(sync_client)
        sem = AsyncSemaphore(twin, limit=1)
        assert await sem.count("twin") == 1  # db 3, where the sync slot is
        await sem.admin.force_release_all("twin")
        await close(twin)

    run(main)


def test_redis_down_raises_backend_error_promptly(own_redis: RedisServer) -> None:
    async def main() -> None:
        sem = AsyncSemaphore(own_redis.url, limit=1)
        own_redis.stop()
        started = time.monotonic()
        with pytest.raises(SemaphoreBackendError) as info:
            await sem.acquire("k")
        assert time.monotonic() - started < 5
        assert info.value.key == "k"
        assert isinstance(info.value.__cause__, redis.ConnectionError)
        await sem.aclose()

    run(main)


def test_a_key_of_the_wrong_type_is_a_backend_error(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    client.set("semaphore:{k}", "not a sorted set")

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            with pytest.raises(SemaphoreBackendError, match="WRONGTYPE"):
                await sem.acquire("k")

    run(main)


def _evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_200_slots_share_one_renewal_task_and_only_the_force_released_one_is_lost(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sync = Semaphore(redis_server.url, limit=200)

    async def main() -> None:
        async with (
            AsyncSemaphore(redis_server.url, limit=200, lease=2.0) as sem,
            contextlib.AsyncExitStack() as stack,
        ):
            slots = [
                await stack.enter_async_context(sem.hold("k", heartbeat=0.5)) for _ in range(200)
            ]
            renewers = [t for t in asyncio.all_tasks() if t.get_name() == "semaphore-renewer"]
            assert len(renewers) == 1
            client.config_resetstat()
            await asyncio.sleep(2.5)  # five renewal intervals, past the first lease
            calls = await asyncio.to_thread(_evalsha_calls, client)
            # One call per tick (about five) instead of one per slot per tick (about 1,000).
            assert calls <= 25, f"{calls} EVALSHA calls for 200 slots over 2.5 s"
            assert not any(s.lost.is_set() for s in slots)
            victim = slots[57]
            assert await asyncio.to_thread(sync.admin.force_release, "k", victim.token)
            await asyncio.wait_for(victim.lost.wait(), 10)
            assert "gone" in str(victim.lease_lost_error())
            await asyncio.sleep(1.0)  # two more ticks: nobody else may be reported lost
            assert [i for i, s in enumerate(slots) if s.lost.is_set()] == [57]
            with contextlib.suppress(SemaphoreLeaseLostError):
                await stack.aclose()
            assert await sem.count("k") == 0
            await asyncio.wait_for(asyncio.gather(*renewers), 10)  # it ends with the last slot

    run(main)


def test_50_coroutines_on_limit_5_with_waits_never_exceed_5(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=5, lease=10.0) as sem:

            def body(n: int) -> Callable[[AsyncSlot], Awaitable[None]]:
                async def work(slot: AsyncSlot) -> None:
                    with history.run(client, history.BODIES, "legacy-api", task_id=f"c{n}"):
                        await asyncio.sleep(0.02)  # the body's own work, not a wait

                return work

            await asyncio.gather(*(sem.run("legacy-api", body(n), wait=60.0) for n in range(50)))
            assert await sem.count("legacy-api") == 0

    run(main)
    bodies = history.History.load(client, history.BODIES)
    bodies.assert_ok({"legacy-api": 5}, tasks=[f"c{n}" for n in range(50)])
