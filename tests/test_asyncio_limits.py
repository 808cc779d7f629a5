"""Live limits from asyncio code, on a real Redis: ``AsyncSemaphore.set_limit`` and
``live_limit`` write and read the same hash as the sync semaphore and the CLI, the next
acquire of any caller uses the limit, a raise wakes waiting callers and starts parked runs,
and bad arguments are refused before anything is written."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_semaphore import Semaphore, SemaphoreValidationError
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.core.names import redis_keys
from celery_semaphore.testing import RedisServer

from .helpers import Published
from .test_asyncio import run


def test_set_limit_is_used_by_the_next_acquire_of_every_caller(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    sync = Semaphore(redis_server.url, limit=5)

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=5) as sem:
            assert await sem.admin.live_limit("k") is None
            with caplog.at_level(logging.WARNING, "celery_semaphore.core.live"):
                assert await sem.admin.set_limit("k", 1, by="ops") is None
            assert "live limit set to 1 (was none) by ops" in caplog.text
            live = await sem.admin.live_limit("k")
            assert live is not None
            assert (live.limit, live.by) == (1, "ops")
            assert live.set_at > 0
            assert sync.admin.live_limit("k") == live  # one hash for both
            first = await sem.acquire("k", limit=5)
            assert first is not None
            assert first.limit == 1  # the live limit wins over the caller's
            assert await sem.acquire("k", limit=5) is None
            assert await asyncio.to_thread(sync.acquire, "k") is None
            assert await sem.available("k", limit=5) == 0
            # Set from the sync side, read and used here.
            assert await asyncio.to_thread(sync.admin.set_limit, "k", 2) == 1
            second = await sem.acquire("k")
            assert second is not None
            assert second.limit == 2
            assert await sem.admin.set_limit("k", None) == 2  # by default "user@host pid N"
            assert await sem.admin.live_limit("k") is None
            assert await sem.available("k") == 3  # the semaphore's 5, two held
            assert await first.release()
            assert await second.release()

    run(main)
    client = redis.Redis.from_url(redis_server.url)
    assert client.exists(redis_keys("semaphore", "k").limits) == 0  # gone with the clear
    client.close()


def test_raising_a_limit_wakes_a_waiting_coroutine_and_starts_parked_runs(
    redis_server: RedisServer,
) -> None:
    published = Published()
    sync = Semaphore(redis_server.url, limit=1)
    blocked = redis_keys("semaphore", "k").blocked

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1, on_handoff=published) as sem:
            holder = await sem.acquire("k")
            assert holder is not None
            waiting = asyncio.ensure_future(sem.acquire("k", wait=60.0))
            while not await sem.client.zcard(blocked):
                await asyncio.sleep(0.01)
            assert await sem.admin.set_limit("k", 2) is None
            # Well before its 60 s: the raise woke it (or its next block ended, 2 s at most).
            woken = await asyncio.wait_for(waiting, 30)
            assert woken is not None
            assert woken.limit == 2
            # A parked run is started by the raise, published through this semaphore's
            # on_handoff in the same call that stores the limit.
            assert await asyncio.to_thread(sync.room.park, "k", "w1", b"1") is not None
            assert await sem.admin.set_limit("k", 3) == 2
            assert published.waiters == ["w1"]
            assert await woken.release()
            assert await holder.release()

    run(main)


@pytest.mark.parametrize(
    "call",
    [
        lambda sem: sem.admin.set_limit("k", 0),
        lambda sem: sem.admin.set_limit("k", 2.5),
        lambda sem: sem.admin.set_limit("k", "3"),
        lambda sem: sem.admin.set_limit("k", True),
        lambda sem: sem.admin.set_limit("", 2),
        lambda sem: sem.admin.set_limit(None, 2),
        lambda sem: sem.admin.set_limit("k", 2, by=""),
        lambda sem: sem.admin.live_limit(""),
        lambda sem: sem.available("k", limit=0),
        lambda sem: sem.available(""),
    ],
)
def test_bad_live_limit_arguments_are_refused_before_anything_is_written(
    redis_server: RedisServer, client: redis.Redis, call: Any
) -> None:
    refused_before_writing(redis_server, client, call)


def refused_before_writing(
    redis_server: RedisServer, client: redis.Redis, call: Callable[[AsyncSemaphore], Any]
) -> None:
    """Assert that awaiting ``call(sem)`` raises SemaphoreValidationError, and that the
    server is still empty."""

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            with pytest.raises(SemaphoreValidationError):
                await call(sem)

    run(main)
    assert client.dbsize() == 0
