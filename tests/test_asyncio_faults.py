"""The asyncio semaphore under cancellation and loss, on real redis-server processes.

Every wait here is on an event or a condition, with seconds of margin; the few fixed sleeps
are the fault itself (a server paused for a while) and say so.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis import asyncio as aioredis

from celery_semaphore import Semaphore, SemaphoreLeaseLostError
from celery_semaphore.asyncio import AsyncSemaphore, AsyncSlot
from celery_semaphore.asyncio.acquiring import Acquirer
from celery_semaphore.core.names import redis_keys
from celery_semaphore.testing import RedisServer

from .test_asyncio import close, run


async def until(predicate: Any, timeout: float = 30.0) -> None:
    """Await until ``predicate()`` is truthy, checking every 20 ms; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def _evalsha_calls(client: redis.Redis) -> int:
    """EVALSHA calls that ran a script (not those answered NOSCRIPT, before a SCRIPT LOAD)."""
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))


def cancelled_while_frozen(own_redis: RedisServer, ask: Callable[[AsyncSemaphore], Any]) -> int:
    """Send ``ask(sem)`` (an acquire) to a frozen server, cancel it, wake the server and close
    the semaphore, which waits for the round trips still running on its behalf. Returns how
    many EVALSHA calls ran, a first ``count`` (which connects) included."""
    admin = own_redis.client()

    async def main() -> None:
        client = aioredis.Redis(host="127.0.0.1", port=own_redis.port)  # no socket timeout
        sem = AsyncSemaphore(client, limit=1, lease=30.0)
        await sem.count("k")  # connect, so the frozen call is the acquire itself
        own_redis.pause()
        try:
            asking = asyncio.ensure_future(ask(sem))
            await asyncio.sleep(0.3)  # the fault: the acquire is sent and nothing answers
            asking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asking
        finally:
            own_redis.resume()
        assert await sem.aclose() == []
        await close(client)

    admin.config_resetstat()
    run(main)
    calls = _evalsha_calls(admin)
    admin.close()
    return calls


def test_an_acquire_cancelled_while_redis_is_frozen_leaves_no_slot_held(
    own_redis: RedisServer,
) -> None:
    # The acquire ran once Redis woke, and took the slot; a release gave it back, long
    # before its 30 s lease would have freed it: count, acquire, release.
    assert cancelled_while_frozen(own_redis, lambda sem: sem.acquire("k")) == 3
    sync = Semaphore(own_redis.client(), limit=1, lease=30.0)
    assert sync.count("k") == 0
    assert sync.acquire("k") is not None
    sync.client.close()


def test_acquires_cancelled_at_random_moments_never_leak_a_slot(
    redis_server: RedisServer, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync = Semaphore(client, limit=3, lease=30.0)
    rng = random.Random(13)
    given_back: list[str] = []
    give_back = Acquirer.give_back

    async def counted(self: Acquirer, keys: Any, key: str, token: str) -> None:
        given_back.append(token)
        await give_back(self, keys, key, token)

    monkeypatch.setattr(Acquirer, "give_back", counted)

    async def main() -> int:
        got = 0
        async with AsyncSemaphore(redis_server.url, limit=3, lease=30.0) as sem:
            for _ in range(150):
                try:
                    slot = await asyncio.wait_for(sem.acquire("k"), rng.uniform(0, 0.002))
                except asyncio.TimeoutError:
                    continue
                assert slot is not None
                got += 1
                assert await slot.release() is True
            await until(lambda: sync.count("k") == 0, timeout=10)
            assert await sem.aclose() == []  # nothing was left to give back
        return got

    got = run(main)
    assert sync.count("k") == 0
    # Cancelled calls whose acquire had started took a slot, and each was given back.
    assert given_back, f"no acquire was cancelled in flight ({got} of 150 completed)"


def test_a_cancelled_body_gives_its_slot_back(redis_server: RedisServer) -> None:
    sync = Semaphore(redis_server.url, limit=1)

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=30.0) as sem:
            entered = asyncio.Event()

            async def body(slot: AsyncSlot) -> None:
                entered.set()
                await asyncio.Event().wait()  # until cancelled

            task = asyncio.ensure_future(sem.run("k", body))
            await asyncio.wait_for(entered.wait(), 30)
            assert await sem.count("k") == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await sem.count("k") == 0  # released before the cancellation came out
            assert await sem.aclose() == []

    run(main)
    assert sync.acquire("k") is not None


def test_a_wait_cancelled_while_blocked_leaves_nothing_behind(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    blocked = redis_keys("semaphore", "k").blocked

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=30.0) as sem:
            holder = await sem.acquire("k")
            assert holder is not None
            waiting = asyncio.ensure_future(sem.acquire("k", wait=60.0))
            await until(lambda: client.zcard(blocked) == 1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert client.zcard(blocked) == 0  # the registration went with it
            assert await sem.count("k") == 1  # only the holder
            # The next waiter is woken by the holder's release as usual.
            after = asyncio.ensure_future(sem.acquire("k", wait=60.0))
            await until(lambda: client.zcard(blocked) == 1)
            await holder.release()
            slot = await asyncio.wait_for(after, 30)
            assert slot is not None
            assert await slot.release() is True

    run(main)


def test_force_release_all_marks_the_slot_lost_and_hold_raises(redis_server: RedisServer) -> None:
    async def main() -> AsyncSlot:
        async with AsyncSemaphore(redis_server.url, limit=3, lease=2.0) as sem:
            with pytest.raises(SemaphoreLeaseLostError) as info:
                async with sem.hold("shared", heartbeat=0.2) as slot:
                    assert await sem.admin.force_release_all("shared") == 1
                    await asyncio.wait_for(slot.lost.wait(), 10)
                    # The body returns normally: the loss is reported all the same.
            assert "gone" in str(info.value)
            assert info.value.key == "shared"
            assert await sem.admin.force_release_all("shared") == 0
            return slot

    assert run(main).lost.is_set()


def test_a_failing_body_keeps_its_own_exception_when_the_slot_was_lost(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=2.0) as sem:
            with pytest.raises(KeyError):
                async with sem.hold("k", heartbeat=0.1) as slot:
                    await sem.admin.force_release_all("k")
                    await asyncio.wait_for(slot.lost.wait(), 10)
                    raise KeyError("the body's own failure")

    run(main)


def test_a_paused_server_loses_the_slot_at_its_deadline(own_redis: RedisServer) -> None:
    errors: list[BaseException] = []

    async def main() -> float:
        client = aioredis.Redis(host="127.0.0.1", port=own_redis.port)  # no socket timeout
        sem = AsyncSemaphore(client, limit=1, lease=1.0)
        try:
            with pytest.raises(SemaphoreLeaseLostError, match="within one lease"):
                async with sem.hold("k", on_renew_error=errors.append) as slot:
                    own_redis.pause()
                    try:
                        await asyncio.wait_for(slot.lost.wait(), 10)
                        late = time.monotonic() - slot.deadline
                    finally:
                        own_redis.resume()
        finally:
            await close(client)
        return late

    late = run(main)
    # The renewals hang; the renewer judges the slot at its own deadline all the same.
    assert late < 1.0, f"the loss was declared {late:.2f}s after the deadline"
    assert errors, "the hung renewals were not reported"
    assert "did not answer" in str(errors[0])


def test_interrupt_cancels_the_body_and_hold_raises(redis_server: RedisServer) -> None:
    seen: list[str] = []

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, lease=2.0) as sem:
            with pytest.raises(SemaphoreLeaseLostError, match="gone"):
                async with sem.hold("k", heartbeat=0.1, interrupt=True):
                    await sem.admin.force_release_all("k")
                    try:
                        await asyncio.sleep(60)
                    except asyncio.CancelledError:
                        seen.append("cancelled")
                        raise
                    seen.append("slept on")
            # The cancellation was taken back: this task carries on as usual.
            await asyncio.sleep(0.01)
            task = asyncio.current_task()
            assert task is not None
            if hasattr(task, "cancelling"):
                assert task.cancelling() == 0

    run(main)
    assert seen == ["cancelled"]


def test_with_interrupt_a_cancel_from_outside_stays_a_cancel(redis_server: RedisServer) -> None:
    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            entered = asyncio.Event()

            async def body(slot: AsyncSlot) -> None:
                entered.set()
                await asyncio.sleep(60)

            task = asyncio.ensure_future(sem.run("k", body, interrupt=True))
            await asyncio.wait_for(entered.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await sem.count("k") == 0

    run(main)


def test_aclose_gives_back_every_slot_still_held_and_says_which(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    sync = Semaphore(redis_server.url, limit=3)

    async def main() -> None:
        sem = AsyncSemaphore(redis_server.url, limit=3, lease=30.0)
        first = await sem.acquire("k")
        second = await sem.acquire("k")
        assert first is not None
        assert second is not None
        assert await second.release() is True
        entered = asyncio.Event()

        async def body(slot: AsyncSlot) -> None:
            entered.set()
            await asyncio.sleep(60)

        holding = asyncio.ensure_future(sem.run("k", body, interrupt=True))
        await asyncio.wait_for(entered.wait(), 30)
        assert await sem.count("k") == 2
        with caplog.at_level(logging.WARNING, logger="celery_semaphore"):
            closed = await sem.aclose()
        assert first in closed
        assert len(closed) == 2  # the first slot and the body's, not the released one
        assert all(s.released and s.lost.is_set() for s in closed)
        # The body still running was interrupted: its slot is gone.
        with pytest.raises(SemaphoreLeaseLostError, match="closed"):
            await holding
        assert await asyncio.to_thread(sync.count, "k") == 0

    run(main)
    lines = [r.getMessage() for r in caplog.records if "still held at close" in r.getMessage()]
    assert len(lines) == 2
    assert all("given back" in line for line in lines)
