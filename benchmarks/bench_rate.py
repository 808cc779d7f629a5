"""A fleet-wide start rate: a burst of runs through several workers, held to the rate.

    python benchmarks/bench_rate.py [--runs 1000] [--workers 4] [--concurrency 4]
                                    [--duration 0.05] [--setups requests tokens]
    python benchmarks/bench_rate.py --modes --runs 200 --workers 3 --concurrency 2

Private redis-servers (broker and store); ``--workers`` prefork workers of ``backlog_app``
(``-c concurrency`` each) share one key with a limit of 20. Each body records its start
(``time.time()``, the same clock as the Redis server's on this machine) and its units
outside the library. Two setups:

* **requests**: ``rate="10/s"`` (burst 1): one start every 100 ms;
* **tokens**: ``rate=["20/s", Rate("60000/m", name="tokens", burst=300, units=...)]``, each
  run's tokens drawn from 50 to 150 (its argument): 1,000 tokens a second, and never more
  than 20 runs a second.

``--modes`` runs two other setups instead: ``rate="10/s"`` with a limit of 5, by runs that
park in the room at once (``on_full="queue"``) and by runs that wait in their pool process
first (``on_full="wait"``); their throughput (runs a second from the first start to the
last) is the figure to compare with the rate.

Reported, per setup (issue 25's targets): the most units started in any 1 s window against
the rate plus the burst, by the bodies' starts and by the instants the store granted (a
hand-off's ``eta``; a start's own time when it took a free slot in person); the units
started per second over the 30 s from 10 s after the first start, against the rate (within
5 %); how late each body started after the instant the store gave it (median and p95, ms;
a run that came later than its slack and was given a new instant counts against the old
one); and how far the starts fell behind the ideal schedule (median, ms), the k-th start's
place in it being an anchor plus the units before it at the rate, from the earliest anchor
no start comes before: each instant a late run left unused moves every later start one
spacing behind it.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
from typing import Any

from bench_worker import prefork_worker
from rich.console import Console
from rich.table import Table

from celery_semaphore.testing import RedisServer

SETUPS = {
    # name: (task, units per second, burst, the runs' token counts or None)
    "requests: 10/s": ("rated", 10.0, 1, None),
    "tokens: 60000/m, burst 300": ("rated_tokens", 1000.0, 300, (50, 150)),
}
MODES = {
    # --modes: the same rate, limit 5, runs that park at once against runs that wait first
    "queue: 10/s, limit 5": ("rated5_queue", 10.0, 1, None),
    "wait: 10/s, limit 5": ("rated5_wait", 10.0, 1, None),
}
SETUPS.update(MODES)


def busiest(rows: list[tuple[float, int]]) -> int:
    """The most units in any 1 s window of ``(instant, units)`` rows (each window opening
    at one of them)."""
    return max(sum(u for at, u in rows if t <= at < t + 1.0) for t, _ in rows)


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    task, per_second, burst, tokens = SETUPS[name]
    rng = random.Random(7)
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(RedisServer())
        store = stack.enter_context(RedisServer())
        apps = [stack.enter_context(prefork_worker(broker.url, store.url, args.concurrency,
                                                   name=f"rate{i}"))
                for i in range(args.workers)]  # fmt: skip
        app, client = apps[0], store.client()
        sent = []
        for n in range(args.runs):
            extra = (rng.randint(*tokens),) if tokens else ()
            sent.append(app.send_task(task, (n, args.duration, *extra)))
        for result in sent:
            result.get(timeout=args.runs / per_second * 200 + 600)
        records = [raw.decode().split() for raw in client.lrange("bench:starts", 0, -1)]
        rows = sorted((float(at), int(units)) for at, units, _ in records)
        grants = sorted((float(at), int(units)) for _, units, at in records)
        after = [(float(at) - float(g)) * 1000 for at, _, g in records]
        client.close()
    starts = [at for at, _ in rows]
    units = [u for _, u in rows]
    window = busiest(rows)
    first = starts[0]
    span = min(30.0, starts[-1] - first - 10)
    steady = sum(u for at, u in rows if first + 10 <= at < first + 10 + span) / span
    # The k-th start's due instant: the units started before it, at the rate, after the
    # burst, from the earliest anchor that no start comes before (the store's clock is
    # not read here): how late a start came is measured against the best schedule the
    # starts allow.
    offsets, before = [], 0
    interval = 1.0 / per_second
    for _, u in rows:
        offsets.append(max(0, before + u - burst) * interval)
        before += u
    anchor = min(at - off for at, off in zip(starts, offsets, strict=True))
    late = [(at - anchor - off) * 1000 for at, off in zip(starts, offsets, strict=True)]
    return {
        "busiest_second": window,
        "busiest_granted": busiest(grants),
        "bound": per_second + burst,
        "steady": steady,
        "rate": per_second,
        "late_median": statistics.median(late),
        "late_p95": statistics.quantiles(late, n=20)[-1],
        "late_max": max(late),
        "grant_median": statistics.median(after),
        "grant_p95": statistics.quantiles(after, n=20)[-1],
        "grant_max": max(after),
        "runs": len(rows),
        "throughput": (len(rows) - 1) / (starts[-1] - first),
        "x_rate": (len(rows) - 1) / (starts[-1] - first) / per_second,
        "units": sum(units),
    }


def _cell(rows: list[dict[str, Any]], field: str, form: str = "{:.0f}") -> str:
    """Median (min-max) of ``field`` over the rounds."""
    values = [row[field] for row in rows]
    median = form.format(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} ({form.format(min(values))}-{form.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--duration", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--setups", nargs="*", choices=list(SETUPS),
                        default=[name for name in SETUPS if name not in MODES])  # fmt: skip
    parser.add_argument("--modes", action="store_true", help="queue against wait, limit 5")
    args = parser.parse_args()
    if args.modes:
        args.setups = list(MODES)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in args.setups}
    for _ in range(args.rounds):  # interleaved: each round runs every setup once
        for name in args.setups:
            rows[name].append(run(name, args))
            print(f"{name}: {rows[name][-1]}", file=sys.stderr, flush=True)
    table = Table(
        title=f"{args.runs} runs, {args.workers} prefork workers -c {args.concurrency}, limit 20"
        f" (5 with --modes),"
        f" bodies of {args.duration}s, {args.rounds} round(s): median (min-max); units are runs"
        " (requests) or tokens"
    )
    for column in ("setup", "busiest second: starts", "granted", "rate + burst",
                   "steady 30 s, per s", "start after its instant, ms: median", "p95",
                   "behind the ideal schedule, ms", "runs a second", "x rate", "runs"):  # fmt: skip
        table.add_column(column)
    for name, found in rows.items():
        table.add_row(name, _cell(found, "busiest_second"), _cell(found, "busiest_granted"),
                      f"{found[0]['bound']:g}", _cell(found, "steady", "{:.1f}"),
                      _cell(found, "grant_median"), _cell(found, "grant_p95"),
                      _cell(found, "late_median"),
                      _cell(found, "throughput", "{:.2f}"), _cell(found, "x_rate", "{:.2f}"),
                      "/".join(str(r["runs"]) for r in found))  # fmt: skip
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
