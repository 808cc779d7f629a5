"""What one sweep of one waiting room costs the store, as the room grows.

    python benchmarks/bench_room_sweep.py [--sizes 1000 10000 50000] [--rounds 15]
        [--against DIR]

A room of N parked waiters stands behind a held slot (limit 1), so nothing drains and each
sweep finds nothing to do: the steady state of a large backlog, which every sweep pays for.
Each round runs, on one private redis-server, one sweep of the room and one plain
acquire+release pair (the anchor), and reads Redis's own time for each call from SLOWLOG
(threshold 0). With ``--against DIR`` (a checkout of an older version, say from
``git archive <commit> | tar -x -C DIR``), the same rounds also sweep a room of the same size
parked by that version, interleaved. Figures are medians (min-max) over rounds.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from celery_semaphore import Semaphore
from celery_semaphore.testing import RedisServer

PAYLOAD = b"x" * 300
"""About the size of a small task's message."""


def _older(directory: str) -> Any:
    """The ``celery_semaphore`` package in ``directory``, imported under another name."""
    copy = Path(tempfile.mkdtemp()) / "celery_semaphore_older"
    shutil.copytree(Path(directory) / "celery_semaphore", copy)
    sys.path.insert(0, str(copy.parent))
    return importlib.import_module("celery_semaphore_older")


def _room(sem: Any, key: str, size: int) -> None:
    """Hold ``key``'s one slot and park ``size`` waiters behind it."""
    assert sem.acquire(key) is not None
    for n in range(size):
        sem.room.park(key, f"w{n}", PAYLOAD)


def _server_us(client: redis.Redis, call: Any) -> float:
    """Redis's own microseconds for the commands ``call`` sends (SLOWLOG, threshold 0)."""
    client.slowlog_reset()
    call()
    return float(sum(entry["duration"] for entry in client.slowlog_get(128)
                     if entry["command"].split()[0].upper() != b"SLOWLOG"))  # fmt: skip


def _spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    return (f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--against", help="a directory holding an older celery_semaphore")
    args = parser.parse_args()
    versions: dict[str, Any] = {"this": Semaphore}
    if args.against:
        versions["older"] = _older(args.against).Semaphore
    table = Table(title="one sweep of a room of N parked (server time, us)")
    table.add_column("N")
    table.add_column("acquire+release (anchor)")
    for name in versions:
        table.add_column(f"sweep, {name}")
        table.add_column(f"{name} / anchor")
    for size in args.sizes:
        with RedisServer(extra_args=("--slowlog-log-slower-than", "0")) as server:
            client = server.client()
            sems = {name: cls(server.url, limit=1, lease=3600.0, claim_timeout=30.0)
                    for name, cls in versions.items()}  # fmt: skip
            plain = Semaphore(server.url, limit=1, lease=60.0)
            for name, sem in sems.items():
                _room(sem, f"room-{name}", size)
            anchor: list[float] = []
            sweeps: dict[str, list[float]] = {name: [] for name in sems}
            for _ in range(args.rounds):

                def pair(plain: Semaphore = plain) -> None:
                    slot = plain.acquire("anchor")
                    assert slot is not None
                    slot.release()

                anchor.append(_server_us(client, pair))
                for name, sem in sems.items():
                    sweeps[name].append(
                        _server_us(client, lambda s=sem, n=name: s.room.sweep(f"room-{n}"))
                    )
            row = [f"{size:,}", _spread(anchor)]
            for name in sems:
                ratios = [s / a for s, a in zip(sweeps[name], anchor, strict=True)]
                row += [_spread(sweeps[name]), _spread(ratios, "{:.1f}x")]
            table.add_row(*row)
            client.close()
    Console().print(table)


if __name__ == "__main__":
    main()
