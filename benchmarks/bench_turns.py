"""The cost of a turn through the waiting room, on the server: what a park, a release that
hands its slot off and a claim cost Redis, against a plain acquire.

    python benchmarks/bench_turns.py [--sizes 1000 50000] [--batch 100] [--rounds 10]
                                     [--payload 550]

One private redis-server. Each room size S gets its own key, ``turns:<S>``, of limit B (the
batch), whose B slots are held and behind which S runs are parked (``WaitingRoom.park``,
payloads of ``--payload`` bytes, about what ``payload_of`` makes for a small task's message).
Each round then runs, for each size, batches of B calls of one kind each, and reads Redis's
own microseconds per EVALSHA (``INFO commandstats``, reset before each batch):

* **plain acquire** (the anchor) and **plain release**: ``Semaphore.acquire`` and
  ``Slot.release`` on a key with no room (B holders while measuring);
* **release with hand-off**: the B held slots of ``turns:<S>`` released, each reserving the
  freed slot for the oldest parked run and answering its payload (caught by ``on_handoff``);
* **claim**: each of those B runs taking its reservation (``WaitingRoom.claim``); they then
  hold the slots the next round's releases hand off;
* **park**: B new runs that find the key full and park, which brings the room back to S.

Reported per size: microseconds per call and the ratio to the plain acquire of the same
round, median (min-max) over rounds, and how the larger room's cost compares with the
smallest's: a per-call cost that grows with the backlog shows there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from celery_semaphore import Semaphore
from celery_semaphore.core.replies import Handoff, Parked
from celery_semaphore.core.slot import Slot
from celery_semaphore.testing import RedisServer

HOLD = 24 * 3600.0  # lease of every slot here: none lapses during a run
KINDS = ("plain acquire", "plain release", "park", "release with hand-off", "claim")


def _usec_per_call(client: redis.Redis, calls: int, run: Callable[[], None]) -> float:
    """Redis's microseconds per EVALSHA while ``run`` makes ``calls`` of them."""
    client.config_resetstat()
    run()
    found = client.info("commandstats").get("cmdstat_evalsha", {})
    assert int(found.get("calls", 0)) == calls, (found, calls)
    return float(found["usec"]) / calls


class Turns:
    """One room size's key: its B held slots and its S parked runs."""

    def __init__(self, sem: Semaphore, size: int, batch: int, payload: bytes) -> None:
        self.sem, self.size, self.batch, self.payload = sem, size, batch, payload
        self.key = f"turns:{size}"
        held = [sem.acquire(self.key, limit=batch, lease=HOLD) for _ in range(batch)]
        assert all(held)
        self.held: list[Slot] = [s for s in held if s is not None]
        self.handed: list[Handoff] = []
        started = time.monotonic()
        self.park(size)
        print(f"room of {size} parked in {time.monotonic() - started:.0f} s", file=sys.stderr,
              flush=True)  # fmt: skip

    def park(self, count: int) -> None:
        for _ in range(count):
            parked = self.sem.room.park(self.key, str(uuid.uuid4()), self.payload,
                                        limit=self.batch, lease=HOLD)  # fmt: skip
            assert isinstance(parked, Parked), parked

    def park_batch(self) -> None:
        self.park(self.batch)

    def release(self) -> None:
        for slot in self.held:
            assert slot.release()
        assert len(self.handed) == self.batch, len(self.handed)
        self.held = []

    def claim(self) -> None:
        handed, self.handed = self.handed, []
        for handoff in handed:
            slot = self.sem.room.claim(self.key, handoff.waiter, limit=self.batch, lease=HOLD)
            assert isinstance(slot, Slot), slot
            self.held.append(slot)


def run(args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    batch = args.batch
    costs: dict[int, dict[str, list[float]]] = {s: {k: [] for k in KINDS} for s in args.sizes}
    with RedisServer() as server:
        client = server.client()
        rooms: dict[str, Turns] = {}

        def caught(key: str, handoffs: Sequence[Handoff]) -> None:
            rooms[key].handed.extend(handoffs)

        sem = Semaphore(client, limit=batch, lease=HOLD, on_handoff=caught)
        payload = b"x" * args.payload
        for size in args.sizes:
            turns = Turns(sem, size, batch, payload)
            rooms[turns.key] = turns
        # Warm: every script loaded, every key's names encoded.
        for turns in rooms.values():
            turns.release()
            turns.claim()
            turns.park(batch)
        plain: list[Any] = []
        for round_ in range(args.rounds):
            order = args.sizes if round_ % 2 == 0 else args.sizes[::-1]
            for size in order:
                turns = rooms[f"turns:{size}"]
                cost = costs[size]

                def take() -> None:
                    plain.extend(sem.acquire("plain", limit=batch) for _ in range(batch))

                def give_back() -> None:
                    for slot in plain:
                        assert slot.release()
                    plain.clear()

                cost["plain acquire"].append(_usec_per_call(client, batch, take))
                cost["plain release"].append(_usec_per_call(client, batch, give_back))
                cost["release with hand-off"].append(_usec_per_call(client, batch, turns.release))
                cost["claim"].append(_usec_per_call(client, batch, turns.claim))
                cost["park"].append(_usec_per_call(client, batch, turns.park_batch))
                waiting, _ = sem.room.head(turns.key)
                assert waiting == size, (waiting, size)
            print(f"round {round_ + 1}: " + ", ".join(
                f"{s}: " + " ".join(f"{costs[s][k][-1]:.1f}" for k in KINDS) for s in args.sizes
            ), file=sys.stderr, flush=True)  # fmt: skip
    return costs


def _spread(values: list[float], fmt: str) -> str:
    middle, low, high = (fmt.format(v) for v in (statistics.median(values), min(values),
                                                 max(values)))  # fmt: skip
    return f"{middle} ({low}-{high})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 50_000],
                        help="parked runs in the room (default 1000 50000)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=100, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--payload", type=int, default=550, help="bytes per parked payload")
    parser.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    args = parser.parse_args()
    if any(size < args.batch for size in args.sizes):
        parser.error("every --sizes must be at least --batch")
    costs = run(args)
    smallest = min(args.sizes)
    columns = ["operation"]
    for size in args.sizes:
        columns += [f"µs/call, S={size:,}", f"vs plain acquire, S={size:,}"]
    columns += [f"S={s:,} / S={smallest:,}" for s in args.sizes if s != smallest]
    rows = []
    for kind in KINDS:
        row = [kind]
        for size in args.sizes:
            anchor = costs[size]["plain acquire"]
            ratios = [c / a for c, a in zip(costs[size][kind], anchor, strict=True)]
            row += [_spread(costs[size][kind], "{:.1f}"), _spread(ratios, "{:.2f}")]
        for size in args.sizes:
            if size != smallest:
                grown = [b / a for a, b in zip(costs[smallest][kind], costs[size][kind],
                                               strict=True)]  # fmt: skip
                row.append(_spread(grown, "{:.2f}"))
        rows.append(row)
    title = (f"Server µs per call (INFO commandstats), batches of {args.batch}, "
             f"{args.rounds} rounds, interleaved; median (min-max)")  # fmt: skip
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    Console(width=200).print(table)
    if args.markdown:
        print(f"\n{title}:\n")
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for row in rows:
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
