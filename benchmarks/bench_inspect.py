"""How long a worker takes to answer ``celery inspect semaphores`` / ``inspect stats`` with
N semaphore keys in its store, against Celery's 1 s default reply timeout.

    python benchmarks/bench_inspect.py [--keys 10000] [--rounds 5]

One private redis-server holding N keys with a holder each (another worker's), plus one
slot of the reporting worker's. Each round times ``worker_report`` (what both remote-control
commands answer), and, as the anchor in the same rounds, the same read done one key per
round trip (how the report read before it paged). Medians (min-max) over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import redis
from celery import Celery

from celery_semaphore import Semaphore
from celery_semaphore.core.admin import SemaphoreAdmin
from celery_semaphore.core.calls import acquire_call
from celery_semaphore.core.names import Namespace
from celery_semaphore.core.process import member_of
from celery_semaphore.core.scripts import Scripts
from celery_semaphore.integration.remote import worker_report
from celery_semaphore.testing import RedisServer


def _fill(url: str, count: int) -> None:
    client = redis.Redis.from_url(url)
    scripts, names = Scripts(client), Namespace("semaphore", False)
    member = member_of(json.dumps({"worker": "other@host"}))
    for start in range(0, count, 1000):
        scripts.run_many([acquire_call(names.keys_of(f"k:{n}"), 1, 3_600_000, member)
                          for n in range(start, min(count, start + 1000))])  # fmt: skip


def _one_by_one(url: str) -> int:
    admin = SemaphoreAdmin(redis.Redis.from_url(url))
    return sum(len(admin.holders(key)) for key in admin.scan_keys())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with RedisServer() as server:
        _fill(server.url, args.keys)
        app = Celery("bench", broker=server.url, set_as_current=False)
        app.conf.semaphore_url = server.url
        slot = Semaphore(server.url, limit=1).acquire("mine", metadata={"worker": "me@host"})
        assert slot is not None
        report, anchor, truncated = [], [], 0
        for _ in range(args.rounds):
            started = time.perf_counter()
            answer = worker_report(app, "me@host")
            report.append(time.perf_counter() - started)
            truncated += bool(answer["truncated"])
            assert len(answer["held"]) == 1 or answer["truncated"], answer
            started = time.perf_counter()
            _one_by_one(server.url)
            anchor.append(time.perf_counter() - started)

    def row(name: str, times: list[float]) -> str:
        return (
            f"| {name} | {statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"
            f" | {statistics.median(times) / 1.0:.2f} |"
        )

    print(f"{args.keys} keys, {args.rounds} rounds; seconds, median (min-max)\n")
    print("| read | seconds | of Celery's 1 s reply timeout |\n|---|---|---|")
    print(row("worker_report (paged, 0.5 s budget)", report))
    print(row("one key per round trip (before)", anchor))
    print(f"\nreports truncated: {truncated} of {args.rounds}")


if __name__ == "__main__":
    main()
