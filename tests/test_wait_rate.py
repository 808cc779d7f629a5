"""A start rate's throughput for callers that wait (``acquire(wait=...)``, and so
``on_full="wait"``): each waiter refused by the rate wakes at the rate's instant, not at the
store's next timer tick. On a real redis-server (its default ``hz 10``)."""

from __future__ import annotations

import asyncio
import threading
import time

from celery_semaphore import Semaphore
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.testing import RedisServer

RATE = 10.0
"""Starts a second."""
SPAN = 3.0
"""Seconds each measure lasts."""


def _per_second(starts: list[float]) -> float:
    starts.sort()
    return (len(starts) - 1) / (starts[-1] - starts[0])


def test_waiters_start_at_the_rate(redis_server: RedisServer) -> None:
    """Proves: three threads that each take a slot with ``wait``, hold it 50 ms and take
    another, start at the rate (within 25 %: a noisy machine's wake-ups), not at half of it
    (a waiter the rate refused blocked on a BLPOP that Redis timed out only on its next
    tick, up to 100 ms after the instant, and the rate's schedule then ran from that late
    start)."""
    sem = Semaphore(redis_server.url, limit=5, rate=f"{RATE:g}/s")
    starts: list[float] = []
    missed: list[str] = []  # an assert in a thread would not fail the test
    stop = time.monotonic() + SPAN

    def waiter() -> None:
        while time.monotonic() < stop:
            slot = sem.acquire("waits", wait=5)
            if slot is None:
                missed.append("no slot within 5 s")
                return
            starts.append(slot.acquired_at)  # the grant, by the store's clock
            time.sleep(0.05)
            slot.release()

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert missed == []
    assert _per_second(starts) >= 0.75 * RATE, starts


def test_async_waiters_start_at_the_rate(redis_server: RedisServer) -> None:
    """Proves: the same for the asyncio twin's waiters."""

    async def main() -> list[float]:
        starts: list[float] = []
        stop = time.monotonic() + SPAN
        async with AsyncSemaphore(redis_server.url, limit=5, rate=f"{RATE:g}/s") as sem:

            async def waiter() -> None:
                while time.monotonic() < stop:
                    slot = await sem.acquire("waits", wait=5)
                    assert slot is not None
                    starts.append(slot.acquired_at)  # the grant, by the store's clock
                    await asyncio.sleep(0.05)
                    await slot.release()

            await asyncio.gather(*(waiter() for _ in range(3)))
        return starts

    starts = asyncio.run(main())
    assert _per_second(starts) >= 0.75 * RATE, starts
