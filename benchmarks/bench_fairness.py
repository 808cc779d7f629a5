"""Fair turns: tenant A sends a burst, then tenant B a few runs, on one shared key; where do
B's runs start among the starts after they arrive?

    python benchmarks/bench_fairness.py [--burst 500] [--few 5] [--duration 0.05]
                                        [--limit 5] [--concurrency 12] [--rounds 3]

One prefork worker of ``backlog_app`` (``-c concurrency``, prefetch 1) on private
redis-servers. A's burst is sent, and once its messages have all been fetched (the broker's
queue is empty) and it waits in the room, B's runs are sent. Each body records its start
(``time.monotonic()``) outside the library. Two positions are reported for B's last run, as
an index among the starts after an instant (0 is the first start):

* **after B was sent**: every start after the send, which includes the A runs already
  handed a slot at that instant, whose messages were on their way;
* **after B arrived**: the starts after B's runs were all in the room (read from Redis
  in one transaction, polling), less the A runs that held a reservation at that instant:
  the order in which the semaphore gave out slots once B could be served.

The target (issue 12) is B's last run within the first 2L starts after it arrives. The
same runs without ``fair_by`` (``arrival_order``) are the contrast: there B waits behind
all of A's parked runs. Priority (issue 24) is measured on the same burst: B's runs given
a minute's head start (``urgent``) should start next, within the first L + few starts
after they arrive; with ``fair_by`` too (``fair_urgent``), B's runs go to the room's head.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import redis
from bench_worker import prefork_worker
from rich.console import Console
from rich.table import Table

from celery_semaphore.core.names import redis_keys
from celery_semaphore.testing import RedisServer

SETUPS = {
    "fair_by tenant": "fair",
    "arrival order (no fair_by)": "arrival_order",
    "B urgent: head_start 60 s": "urgent",
    "fair_by + B's head_start 60 s": "fair_urgent",
}


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _arrived(store: redis.Redis, few: set[str]) -> tuple[float, set[str]]:
    """Poll until every one of ``few`` is parked, reserved or started; then the instant and
    the waiters that held a reservation then (read in one transaction)."""
    keys = redis_keys("semaphore", "turns")
    while True:
        with store.pipeline(transaction=True) as pipe:
            pipe.hkeys(keys.parked)
            pipe.zrange(keys.slots, 0, -1)
            pipe.lrange("bench:starts", 0, -1)
            parked, members, starts = pipe.execute()
        at = time.monotonic()
        started = {_text(s).split()[2] for s in starts}
        if few <= {_text(p) for p in parked} | started:
            reserved = {_text(m)[1:].split("#")[0] for m in members if _text(m).startswith("~")}
            return at, reserved
        time.sleep(0.001)


def run(task: str, args: argparse.Namespace) -> dict[str, Any]:
    with (
        RedisServer() as broker,
        RedisServer() as store,
        prefork_worker(broker.url, store.url, args.concurrency, BENCH_LIMIT=str(args.limit)) as app,
    ):
        client, queue = store.client(), broker.client()
        burst = [app.send_task(task, ("a", args.duration)) for _ in range(args.burst)]
        room = redis_keys("semaphore", "turns").room
        deadline = time.monotonic() + 120
        while queue.llen("celery") or client.zcard(room) < args.burst // 2:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"A's burst never waited in the room: {queue.llen('celery')} messages in "
                    f"the queue, {client.zcard(room)} runs in the room"
                )
            time.sleep(0.005)
        sent = time.monotonic()
        few = [app.send_task(task, ("b", args.duration)) for _ in range(args.few)]
        arrived, reserved = _arrived(client, {r.id for r in few})
        for result in burst + few:
            result.get(timeout=600)
        starts = sorted(
            (float(at), tenant, task_id)
            for at, tenant, task_id in (
                _text(s).split() for s in client.lrange("bench:starts", 0, -1)
            )
        )
    after_sent = [tenant for at, tenant, _ in starts if at > sent]
    after_arrival = [tenant for at, tenant, tid in starts if at > arrived and tid not in reserved]
    return {
        "sent": max(i for i, t in enumerate(after_sent) if t == "b"),
        "arrived": max((i for i, t in enumerate(after_arrival) if t == "b"), default=0),
        "in_flight": len(reserved),
        "runs": len(starts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=500)
    parser.add_argument("--few", type=int, default=5)
    parser.add_argument("--duration", type=float, default=0.05)
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in SETUPS}
    for _ in range(args.rounds):
        for name, task in SETUPS.items():
            rows[name].append(run(task, args))
            print(f"{name}: {rows[name][-1]}", file=sys.stderr, flush=True)
    table = Table(
        title=f"A sends {args.burst}, then B {args.few}; limit {args.limit}, bodies of "
        f"{args.duration}s, one prefork worker -c {args.concurrency}; {args.rounds} rounds; "
        f"B's last start, as an index: median (min-max); target < 2L = {2 * args.limit}"
    )
    for column in ("setup", "after B was sent", "after B arrived", "A runs in flight then",
                   "body runs"):  # fmt: skip
        table.add_column(column)
    for name, results in rows.items():
        cells = []
        for field in ("sent", "arrived", "in_flight"):
            values = [r[field] for r in results]
            cells.append(f"{statistics.median(values):.0f} ({min(values)}-{max(values)})")
        table.add_row(name, *cells, "/".join(str(r["runs"]) for r in results))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
