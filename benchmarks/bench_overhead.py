"""What the semaphore costs a Celery task: a trivial bounded task against the same task
unbounded, through one prefork worker, limit never reached.

    python benchmarks/bench_overhead.py [--tasks 1000] [--concurrency 4] [--rounds 5]

One worker serves the tasks; each round sends a batch of each, in turns, and times it from
the first send to the last result. Reported: tasks per second for each, and its throughput
as a share of the unbounded one (median, min-max over rounds). Two tasks make round trips
and nothing else: one EVALSHA of a trivial script on the semaphore's Redis (the acquire, the
one round trip a bounded run waits for: the limit), and two (an acquire and a release both
on the run's path, as before releases were sent after the run).

On Linux it also reports the CPU time every process spent per task (the worker and its pool,
both redis-servers, this client; from /proc), and the unbounded task's CPU as a share of
each task's: the share of the throughput a machine saturated by these processes would reach,
which drifts far less than the throughput on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

from bench_worker import prefork_worker
from celery import Celery
from rich.console import Console
from rich.table import Table

from celery_semaphore.testing import RedisServer

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu(pids: list[int]) -> float:
    """CPU seconds (user and system) the processes ``pids`` have used, as /proc tells."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the worker's pool processes)."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [p for child in task.read_text().split() for p in _tree(int(child))]
    return found


def _batch(app: Celery, task: str, count: int, servers: list[int]) -> tuple[float, float]:
    """Tasks per second, and CPU microseconds per task of every process involved."""
    pids = _tree(app.worker_pid) + servers  # type: ignore[attr-defined]
    cpu, started = _cpu(pids) + time.process_time(), time.perf_counter()
    results = [app.send_task(task, (n,)) for n in range(count)]
    for result in results:
        result.get(timeout=600)
    elapsed = time.perf_counter() - started
    return count / elapsed, (_cpu(pids) + time.process_time() - cpu) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tasks = ("noop", "noop_one_trip", "noop_two_trips", "noop_bounded")
    rates: dict[str, list[float]] = {task: [] for task in tasks}
    cpus: dict[str, list[float]] = {task: [] for task in tasks}
    with (
        RedisServer() as broker,
        RedisServer() as store,
        prefork_worker(broker.url, store.url, args.concurrency) as app,
    ):
        servers = [server.process.pid for server in (broker, store) if server.process]
        for task in tasks:  # warm every path up
            _batch(app, task, 100, servers)
        for _ in range(args.rounds):
            for task in tasks:
                rate, cpu = _batch(app, task, args.tasks, servers)
                rates[task].append(rate)
                cpus[task].append(cpu)
    table = Table(title=f"{args.tasks} trivial tasks per batch, one prefork worker "
                        f"-c {args.concurrency}, {args.rounds} rounds")  # fmt: skip
    for column in ("task", "tasks/s", "share of unbounded", "CPU µs per task", "CPU share"):
        table.add_column(column)
    labels = {"noop": "unbounded", "noop_one_trip": "one trivial round trip (the limit)",
              "noop_two_trips": "two trivial round trips",
              "noop_bounded": "bounded, limit never reached"}  # fmt: skip
    for task, label in labels.items():
        share = [v / u for v, u in zip(rates[task], rates["noop"], strict=True)]
        cpu_share = [u / v for v, u in zip(cpus[task], cpus["noop"], strict=True) if v]
        table.add_row(label, _spread(rates[task]), _spread(share, "{:.2f}"),
                      _spread(cpus[task]), _spread(cpu_share, "{:.2f}"))  # fmt: skip
    Console(width=140).print(table)


def _spread(values: list[float], fmt: str = "{:.0f}") -> str:
    if not values:
        return "-"
    return " ".join((fmt.format(statistics.median(values)),
                     f"({fmt.format(min(values))}-{fmt.format(max(values))})"))  # fmt: skip


if __name__ == "__main__":
    main()
