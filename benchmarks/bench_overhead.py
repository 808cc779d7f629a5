"""What the semaphore costs a Celery task: a trivial bounded task against the same task
unbounded, through one prefork worker, limit never reached.

    python benchmarks/bench_overhead.py [--tasks 1000] [--concurrency 4] [--rounds 5]

One worker serves the tasks; each round sends a batch of each, in turns, and times it from
the first send to the last result. Reported: tasks per second for each, and its throughput
as a share of the unbounded one (median, min-max over rounds). The third task makes the two
round trips a bounded run cannot avoid (two EVALSHA of a trivial script on the semaphore's
Redis) and nothing else: what any semaphore costing one round trip to take a slot and one
to give it back would reach at best.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_worker import prefork_worker
from celery import Celery
from rich.console import Console
from rich.table import Table

from celery_semaphore.testing import RedisServer


def _batch(app: Celery, task: str, count: int) -> float:
    started = time.perf_counter()
    results = [app.send_task(task, (n,)) for n in range(count)]
    for result in results:
        result.get(timeout=600)
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"noop": [], "noop_two_trips": [], "noop_bounded": []}
    with (
        RedisServer() as broker,
        RedisServer() as store,
        prefork_worker(broker.url, store.url, args.concurrency) as app,
    ):
        for task in rates:  # warm both paths up
            _batch(app, task, 100)
        for _ in range(args.rounds):
            for task in rates:
                rates[task].append(_batch(app, task, args.tasks))
    table = Table(title=f"{args.tasks} trivial tasks per batch, one prefork worker "
                        f"-c {args.concurrency}, {args.rounds} rounds")  # fmt: skip
    for column in ("task", "tasks/s: median (min-max)", "share of unbounded"):
        table.add_column(column)
    labels = {"noop": "unbounded", "noop_two_trips": "two trivial round trips (the limit)",
              "noop_bounded": "bounded, limit never reached"}  # fmt: skip
    for task, label in labels.items():
        values = rates[task]
        share = [v / u for v, u in zip(values, rates["noop"], strict=True)]
        table.add_row(
            label,
            f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})",
            f"{statistics.median(share):.2f} ({min(share):.2f}-{max(share):.2f})",
        )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
