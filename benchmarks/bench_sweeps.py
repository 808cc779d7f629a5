"""What sweeping the waiting rooms costs a fleet at rest: R rooms, each with one run parked
behind a slot held throughout, swept by W worker processes, with nothing else changing.

    python benchmarks/bench_sweeps.py [--rooms 1000 10000] [--workers 1 4 8] [--window 20]
                                      [--rounds 3] [--against DIR]

Each run starts private redis-servers (one for the broker and results, one for the
semaphore store), makes the R rooms on the store, starts W ``celery worker -P prefork -c 1``
processes of ``backlog_app`` (which has a queueing task, so each sweeps), waits until every
room was swept twice, then measures a steady window of ``--window`` seconds:

- the store's script calls per second (``INFO commandstats``, EVALSHA: the sweeps, plus the
  workers' look-ups of the room index), and the rooms the workers swept per second, by
  their ``swept`` counters (this code only);
- the store's CPU, as a share of one core (``INFO cpu``, user and system), and the workers'
  (every process of the W workers, from /proc);
- a plain task's start: a probe task is sent every 0.25 s, and answers when its body started;
  the delay from its send to that start, p99 (and median) over the window.

``--against DIR`` runs the same with the celery_semaphore found in DIR (say, the code before
the fleet's sweeps: ``git archive <commit> celery_semaphore | tar -x -C DIR``) in the workers,
interleaved with this code. Rounds are interleaved; each figure is the median over them, with
the minimum and maximum.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from bench_overhead import _cpu, _tree
from celery import Celery
from rich.console import Console
from rich.table import Table

from celery_semaphore import Semaphore
from celery_semaphore.testing import RedisServer

HERE = Path(__file__).resolve().parent
INTERVAL = 2.0  # the default semaphore_sweep_interval, which both codes use
PROBE_EVERY = 0.25


@contextlib.contextmanager
def workers(
    broker: str, store: str, count: int, code: str | None
) -> Iterator[tuple[list[int], list[str]]]:
    """``count`` prefork workers (``-c 1``) of backlog_app, started at once, each answering
    a ping when the block starts; their pids and node names. ``code``: a directory whose
    celery_semaphore they import instead of this one."""
    path = os.pathsep.join(p for p in (code, str(HERE)) if p)
    env = {**os.environ, "BENCH_BROKER_URL": broker, "BENCH_SEMAPHORE_URL": store,
           "PYTHONPATH": path}  # fmt: skip
    names = [f"sweeps{n}@{socket.gethostname()}" for n in range(count)]
    command = [sys.executable, "-m", "celery", "-A", "backlog_app", "worker", "-P", "prefork",
               "-c", "1", "--loglevel=ERROR", "--without-gossip", "--without-mingle",
               "--without-heartbeat"]  # fmt: skip
    procs = [
        subprocess.Popen([*command, "-n", name], cwd=HERE, env=env, stdout=subprocess.DEVNULL)
        for name in names
    ]
    app = Celery("bench-client", broker=broker, backend=broker, set_as_current=False)
    try:
        deadline = time.monotonic() + 180
        answered: set[str] = set()
        while len(answered) < count:
            for reply in app.control.ping(timeout=1.0):
                answered.update(reply)
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the workers did not start")
        yield [p.pid for p in procs], names
    finally:
        app.close()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def make_rooms(url: str, count: int) -> None:
    """``count`` rooms, each with one run parked behind a slot held for an hour."""
    sem = Semaphore(url, limit=1, lease=3600.0)
    for n in range(count):
        key = f"bench:{n}"
        assert sem.acquire(key) is not None
        sem.room.park(key, f"waiter-{n}", b"never published")
    sem.client.close()


def _store(client: redis.Redis) -> tuple[int, float]:
    """EVALSHA calls so far, and CPU seconds, of the store."""
    calls = int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    cpu = client.info("cpu")
    return calls, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def _swept(client: redis.Redis, names: list[str]) -> int:
    """Rooms swept so far by the workers ``names``, by their counters (0 for a code without
    them), read by name: a SCAN for them would take seconds in a keyspace of 40,000 keys,
    and be measured. Each worker writes its counts about once a second, so a reading lags by
    up to a second; two readings lag alike, and their difference over a window does not.
    (``inspect stats`` would have them written first, but it also reads every key's
    holders: thousands of script calls.)"""
    return sum(int(client.hget(f"semaphore:stats:{name}", "swept") or 0) for name in names)


def _reading(client: redis.Redis, names: list[str], processes: list[int]) -> list[float]:
    """The store's EVALSHA calls and CPU seconds, the workers' swept rooms and CPU seconds,
    and when (monotonic seconds), read together."""
    calls, cpu = _store(client)
    return [calls, cpu, _swept(client, names), _cpu(processes), time.monotonic()]


def run(rooms: int, count: int, code: str | None, window: float) -> dict[str, Any]:
    with RedisServer() as broker, RedisServer() as store:
        client = store.client()
        make_rooms(store.url, rooms)
        with workers(broker.url, store.url, count, code) as (pids, names):
            app = Celery("bench-probe", broker=broker.url, backend=broker.url,
                         set_as_current=False)  # fmt: skip
            # Steady state: every room swept twice since the workers started (the first pass
            # sets when each room is due next), then an interval.
            first, _ = _store(client)
            deadline = time.monotonic() + 300
            while _store(client)[0] - first < 2 * rooms and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(INTERVAL)
            processes = [p for pid in pids for p in _tree(pid)]
            before = _reading(client, names, processes)
            probes = []
            while time.monotonic() - before[-1] < window:
                probes.append((time.time(), app.send_task("probe")))
                time.sleep(PROBE_EVERY)
            after = _reading(client, names, processes)
            calls, cpu, swept, workers_cpu, elapsed = (
                a - b for a, b in zip(after, before, strict=True)
            )
            delays = sorted(result.get(timeout=300) - sent for sent, result in probes)
            app.close()
    return {
        "rooms": rooms, "workers": count, "code": code or "this",
        "scripts_per_s": calls / elapsed, "swept_per_s": swept / elapsed,
        "store_cpu": cpu / elapsed, "workers_cpu": workers_cpu / elapsed,
        "p99_ms": delays[min(len(delays) - 1, round(0.99 * (len(delays) - 1)))] * 1000,
        "median_ms": statistics.median(delays) * 1000, "probes": len(delays),
    }  # fmt: skip


def _spread(values: list[float], fmt: str = "{:.0f}") -> str:
    return (f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rooms", type=int, nargs="*", default=[1000, 10000])
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 4, 8])
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", metavar="DIR", help="an older celery_semaphore's parent")
    args = parser.parse_args()
    codes: list[str | None] = [None] + ([args.against] if args.against else [])
    cases = [(r, w, c) for r in args.rooms for w in args.workers for c in codes]
    results: dict[tuple[int, int, str | None], list[dict[str, Any]]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for rooms, count, code in cases:
            found = run(rooms, count, code, args.window)
            results[rooms, count, code].append(found)
            print(json.dumps(found), file=sys.stderr, flush=True)
    table = Table(title=f"{args.window:g} s at rest, sweep interval {INTERVAL:g} s; "
                        f"{args.rounds} rounds, interleaved; median (min-max)")  # fmt: skip
    for column in ("R rooms", "W workers", "code", "EVALSHA/s", "rooms swept/s (R/2 = once)",
                   "store CPU, % of a core", "workers' CPU, % of a core",
                   "plain task start p99, ms", "median, ms"):  # fmt: skip
        table.add_column(column)
    for (rooms, count, code), runs in results.items():
        swept = [r["swept_per_s"] for r in runs]
        table.add_row(
            str(rooms), str(count), "this" if code is None else code,
            _spread([r["scripts_per_s"] for r in runs]),
            _spread(swept) if code is None else "-",
            _spread([100 * r["store_cpu"] for r in runs]),
            _spread([100 * r["workers_cpu"] for r in runs]),
            _spread([r["p99_ms"] for r in runs]),
            _spread([r["median_ms"] for r in runs], "{:.1f}"),
        )  # fmt: skip
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
