"""A backlog through one worker: the waiting room against countdown shedding, against the
ideal N*d/L and the same task unbounded on a dedicated ``-c L`` worker.

    python benchmarks/bench_backlog.py [--tasks 200] [--duration 0.2] [--limit 5]
                                       [--concurrency C ...] [--setups NAME ...] [--rounds 3]
                                       [--pool prefork|gevent|eventlet] [--broker redis|amqp]

Each round runs every setup once, interleaved, on fresh private redis-servers (one for the
broker and results, one for the semaphore); with ``--broker amqp`` the broker is the
RabbitMQ on 127.0.0.1:5672 (a queue of the run's own), the results stay on Redis.
Reported per setup: time / ideal (median, min, max over rounds), peak bodies in flight (must
be <= limit), body runs (must be N), semaphore script calls and server commands per task (INFO
commandstats on the semaphore's Redis), the Spearman correlation of start order with send
order, how long each freed slot stood empty while runs waited, how many of those gaps passed
one broker round trip plus 50 ms, and the hand-offs that found nothing to claim (the worker's
``handoffs_missed``: each one a message fetched and dropped).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from typing import Any

import redis
from bench_worker import prefork_worker
from rich.console import Console
from rich.table import Table

from celery_semaphore.integration.waiting_room.queues import SUFFIX
from celery_semaphore.testing import RedisServer

AMQP = "amqp://guest:guest@127.0.0.1:5672//"

SETUPS = {
    # name: (task, worker concurrency or None for --concurrency, message priority or None,
    #        the worker's BENCH_* settings)
    "queue (waiting room)": ("queue", None, None, {}),
    # The waiting room as it was before hand-off queues: each hand-off goes to the back of
    # the run's own queue, behind the rest of the burst.
    "queue, no hand-off queues": ("queue", None, None, {"BENCH_HANDOFF_QUEUES": "0"}),
    # The backlog is sent at kombu's Redis priority 9 (its last list) and hand-offs are
    # published at 0 (semaphore_handoff_priority), so the worker fetches them first.
    "queue, hand-offs first": ("queue", None, 9, {"BENCH_HANDOFF_PRIORITY": "0"}),
    # Without the host's journal of parked runs (a restart of the store then loses them).
    "queue, no journal": ("queue", None, None, {"BENCH_JOURNAL": "0"}),
    # A reservation its run has not claimed is never given to a run that asks in person
    # (semaphore_handoff_grace = 0): the order is kept whatever the consumer's delay.
    "queue, no grace": ("queue", None, None, {"BENCH_HANDOFF_GRACE": "0"}),
    "retry (countdown shedding, defaults)": ("retry", None, None, {}),
    "unbounded, dedicated -c L worker": ("unbounded", "limit", None, {}),
}


def peak(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def spearman(order: list[int]) -> float:
    n = len(order)
    if n < 2:
        return 1.0
    ranks = {value: rank for rank, value in enumerate(sorted(order))}
    moved = sum((ranks[v] - i) ** 2 for i, v in enumerate(order))
    return 1 - 6 * moved / (n * (n * n - 1))


def handoff_gaps(intervals: list[tuple[float, float]], limit: int) -> list[float]:
    """Seconds each freed slot stood empty while runs were waiting: the k-th body to end frees
    the slot the (k+limit)-th body to start takes (slots are interchangeable), so the gap is
    that start minus that end. Only ends before the last start count (after it nobody waits)."""
    starts = sorted(s for s, _ in intervals)
    ends = sorted(e for _, e in intervals)
    return [max(0.0, starts[k + limit] - ends[k]) for k in range(len(starts) - limit)]


def round_trip(client: redis.Redis, n: int = 200) -> float:
    """Median seconds of a PING to ``client``'s server: the broker round trip."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        client.ping()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def missed_handoffs(client: redis.Redis) -> int:
    """Hand-offs that found nothing to claim (the worker's ``handoffs_missed`` counter)."""
    return sum(int(client.hget(key, "handoffs_missed") or 0)
               for key in client.scan_iter(match="semaphore:stats:*"))  # fmt: skip


def script_calls(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats")
    scripts = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    return scripts, sum(v["calls"] for v in stats.values())


def run(setup: str, args: argparse.Namespace) -> dict[str, Any]:
    task, _, priority, settings = SETUPS[setup]
    workers = args.processes
    env = {"BENCH_LIMIT": str(args.limit), **settings}
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    with (
        RedisServer() as broker,
        RedisServer() as store,
        prefork_worker(AMQP if args.broker == "amqp" else broker.url, store.url, workers,
                       args.pool, broker.url, queue, **env) as app,
    ):  # fmt: skip
        client = store.client()
        rtt = round_trip(broker.client())
        client.config_resetstat()
        started = time.monotonic()
        results = [
            app.send_task(task, (n, args.duration), priority=priority) for n in range(args.tasks)
        ]
        for result in results:
            result.get(timeout=600)
        elapsed = time.monotonic() - started
        scripts, commands = script_calls(client)
        time.sleep(1.5)  # the worker's counters are written within a second
        missed = missed_handoffs(client)
        if args.broker == "amqp":
            with app.connection_for_write() as conn:
                for name in (queue, queue + SUFFIX):
                    with contextlib.suppress(Exception):
                        conn.default_channel.queue_delete(name)
        intervals = [
            tuple(map(float, raw.split())) for raw in client.lrange("bench:intervals", 0, -1)
        ]
        order = [int(n) for n in client.lrange("bench:order", 0, -1)]
    ideal = args.tasks * args.duration / args.limit
    gaps = handoff_gaps(intervals, args.limit)  # type: ignore[arg-type]
    if os.environ.get("BENCH_DEBUG"):
        first = min(s for s, _ in intervals)
        ends = sorted(e for _, e in intervals)
        worst = sorted(range(len(gaps)), key=lambda k: -gaps[k])[:15]
        print([(round(ends[k] - first, 2), round(gaps[k] * 1000)) for k in worst], file=sys.stderr)
    return {
        "gap_median_ms": statistics.median(gaps) * 1000 if gaps else 0.0,
        "gap_max_ms": max(gaps) * 1000 if gaps else 0.0,
        # The bound on a freed slot's idle time: one broker round trip plus 50 ms.
        "gaps_over": sum(gap > rtt + 0.05 for gap in gaps),
        "rtt_ms": rtt * 1000,
        "ratio": elapsed / ideal,
        "peak": peak(intervals),  # type: ignore[arg-type]
        "runs": len(intervals),
        "scripts": scripts / args.tasks,
        "commands": commands / args.tasks,
        "spearman": spearman(order),
        "missed": missed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--duration", type=float, default=0.2)
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        help="worker processes for the bounded setups; default: L+1, 2L+2, 4L",
    )
    parser.add_argument("--setups", nargs="*", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool", choices=("prefork", "gevent", "eventlet"), default="prefork",
                        help="the worker's pool (-c is then its greenlets, for gevent and "
                             "eventlet)")  # fmt: skip
    parser.add_argument("--broker", choices=("redis", "amqp"), default="redis")
    args = parser.parse_args()
    limit = args.limit
    sizes = args.concurrency or [limit + 1, 2 * limit + 2, 4 * limit]
    # The unbounded setup runs on a -c L worker whatever the sizes: once per round.
    cases = [(name, limit if SETUPS[name][1] == "limit" else c)
             for name in args.setups for c in sizes
             if SETUPS[name][1] != "limit" or c == sizes[0]]  # fmt: skip
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for name, processes in cases:
            args.processes = processes
            rows[name, processes].append(run(name, args))
            print(f"{name} -c {processes}: {rows[name, processes][-1]}", file=sys.stderr,
                  flush=True)  # fmt: skip
    title = (f"{args.tasks} tasks of {args.duration}s on limit {limit}, one {args.pool} worker "
             f"on {args.broker}; "
             f"{args.rounds} rounds, interleaved; median (min-max)")  # fmt: skip
    table = Table(title=title)
    for column in ("setup", "-c", "time / ideal", "peak", "runs", "scripts/task",
                   "commands/task", "Spearman", "slot idle, ms: median (max)",
                   "idle > RTT + 50 ms", "broker RTT, ms", "missed hand-offs"):  # fmt: skip
        table.add_column(column)
    for (name, processes), runs in rows.items():
        ratios = [r["ratio"] for r in runs]
        table.add_row(
            name,
            str(processes),
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
            str(max(r["peak"] for r in runs)),
            "/".join(str(r["runs"]) for r in runs),
            f"{statistics.median(r['scripts'] for r in runs):.1f}",
            f"{statistics.median(r['commands'] for r in runs):.1f}",
            f"{min(r['spearman'] for r in runs):.3f}",
            f"{statistics.median(r['gap_median_ms'] for r in runs):.0f} "
            f"({max(r['gap_max_ms'] for r in runs):.0f})",
            "/".join(f"{r['gaps_over']}" for r in runs) + f" of {args.tasks - limit}",
            f"{statistics.median(r['rtt_ms'] for r in runs):.2f}",
            "/".join(str(r["missed"]) for r in runs),
        )
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
