"""The core primitive without Celery: acquire, extend and release a slot by hand, or hold one.

python examples/manual_slot.py          # uses REDIS_URL, or starts a private redis-server
"""

from __future__ import annotations

import time
from contextlib import ExitStack

from redis_url import redis_url

from celery_semaphore import Semaphore, SemaphoreNotAcquiredError


def main() -> None:
    with ExitStack() as stack:
        url = redis_url(stack)
        sem = Semaphore(url, limit=2, lease=5.0)

        # acquire returns None when every slot is held: "no capacity" is an ordinary branch.
        first = sem.acquire("reports", metadata={"job": "first"})
        second = sem.acquire("reports", metadata={"job": "second"})
        third = sem.acquire("reports")
        print(f"acquired: {first}, {second}; third: {third}")
        for holder in sem.admin.holders("reports"):
            print(f"  holder {holder.token[:8]} {holder.metadata} expires in {holder.expires_in}s")

        # A slot you acquire yourself is not renewed for you: extend it if work runs long.
        assert first is not None
        assert second is not None
        print("extended:", first.extend(lease=10.0))
        print("released:", first.release(), second.release(), "count now", sem.count("reports"))

        # hold() renews in the background and raises if the slot is lost meanwhile.
        with sem.hold("reports", lease=1.0) as slot:
            time.sleep(2.5)  # longer than the lease: the heartbeat keeps the slot
            print("held through 2.5 s with a 1 s lease; lost?", slot.lost.is_set())

        # run() is hold() around one call; retries wait for a slot instead of failing fast.
        # Two holders that will never release: their slots come back when the lease lapses.
        for _ in range(2):
            sem.acquire("reports", lease=0.5)
        try:
            sem.run("reports", lambda slot: None)
        except SemaphoreNotAcquiredError as exc:
            print("fail fast:", exc)
        print("with retries:", sem.run("reports", lambda s: "ran", retries=20, retry_delay=0.1))


if __name__ == "__main__":
    main()
