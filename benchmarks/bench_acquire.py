"""Round trips and latency of acquire / extend / release against a private redis-server.

    python benchmarks/bench_acquire.py [--n 5000] [--threads 8]

Counts the commands the client sends per operation (each is one request and one reply on
the wire), so "one round trip per acquire" is measured rather than asserted, then times
sequential and threaded acquire+release pairs on loopback.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import redis

from celery_semaphore import Semaphore
from celery_semaphore.testing import RedisServer


class CountingConnection(redis.Connection):
    """A redis-py connection that counts the commands it sends."""

    sent = 0

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        CountingConnection.sent += 1
        super().send_command(*args, **kwargs)


def per_op(url: str, n: int) -> dict[str, float]:
    client = redis.Redis.from_url(url, connection_class=CountingConnection)
    sem = Semaphore(client, limit=n, lease=60.0)
    sem.count("bench")  # loads the scripts' SHAs on first use; not part of the figures
    counts = {}
    CountingConnection.sent = 0
    slots = [sem.acquire("bench") for _ in range(n)]
    counts["acquire"], CountingConnection.sent = CountingConnection.sent / n, 0
    for slot in slots:
        assert slot is not None
        slot.extend()
    counts["extend"], CountingConnection.sent = CountingConnection.sent / n, 0
    for slot in slots:
        assert slot is not None
        slot.release()
    counts["release"] = CountingConnection.sent / n
    return counts


def latency(sem: Semaphore, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        slot = sem.acquire("bench")
        assert slot is not None
        slot.release()
        samples.append(time.perf_counter() - start)
    return samples


def threaded(sem: Semaphore, n: int, threads: int) -> float:
    def work() -> None:
        for _ in range(n // threads):
            slot = sem.acquire("bench-threads", retries=1000, retry_delay=0.0)
            assert slot is not None
            slot.release()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return (n // threads * threads) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    with RedisServer() as server:
        version = server.client().info("server")["redis_version"]
        sem = Semaphore(server.url, limit=args.n, lease=60.0)
        counts = per_op(server.url, 1000)
        samples = latency(sem, args.n)
        small = Semaphore(server.url, limit=4, lease=60.0)
        rate = threaded(small, args.n, args.threads)
    ms = sorted(s * 1000 for s in samples)
    print(f"redis-server {version} on loopback, {args.n} samples")
    for op, calls in counts.items():
        print(f"  Redis commands per {op:8s} {calls:.2f}  round trips")
    print(
        f"  acquire+release, sequential: p50 {statistics.median(ms):.3f} ms, "
        f"p99 {ms[int(len(ms) * 0.99) - 1]:.3f} ms, {len(ms) / (sum(ms) / 1000):.0f} pairs/s"
    )
    print(f"  acquire+release, {args.threads} threads on limit 4: {rate:.0f} pairs/s")


if __name__ == "__main__":
    main()
