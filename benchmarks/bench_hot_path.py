"""The hot path: acquire+release pairs, batched renewal, and what each script costs Redis.

    python benchmarks/bench_hot_path.py [--pairs 3000] [--rounds 5] [--sections pairs ...]

Sections, each printing a table:

* ``pairs``: uncontended acquire+release pairs per second, one client, against the physical
  limit (two EVALSHA of a trivial script through redis-py ``Script`` objects on the same
  connection), redis-py's ``Lock`` and python-redis-lock, in interleaved rounds; the pair
  of a Celery run in a pool of threads or green threads, whose release is handed to the
  release thread (``guard(..., later=True)``) on its own client, timed until the release
  is queued; and the floor under ours: the same two scripts with the same arguments, sent
  bare through :class:`~celery_semaphore.core.scripts.Scripts` (no checks, no slot, no
  reply read beyond the script's own), what is left of the pair with none of this
  library's Python around its round trips.
* ``async-pairs``: the same for :class:`AsyncSemaphore` on one ``redis.asyncio`` client,
  against two async EVALSHA of a trivial script (``redis.asyncio`` ``Script`` objects) on the
  same connection, in interleaved rounds.
* ``renewal``: round trips per renewal tick and renewal threads alive, for 1, 10, 100 and
  1,000 slots held by one process.
* ``release-gap``: how long after a run's end its release, sent later, is answered.
* ``server``: Redis's own microseconds per call (``INFO commandstats``) for acquire, extend
  (batched, per slot) and release, against a minimal sorted-set acquire/release script
  pair, and the pairs-per-second ceiling of one key that follows.

Each section runs on its own private redis-server. Figures are medians (min-max) over rounds.

``--against DIR`` adds a row to ``pairs`` for an older version of this library, in the same
process and rounds: DIR holds its ``celery_semaphore`` package (say, from
``git archive <commit> | tar -x -C DIR``), imported under another name.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis
import redis_lock
from redis import asyncio as aioredis
from rich.console import Console
from rich.table import Table

from celery_semaphore import Semaphore
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.core import heartbeat
from celery_semaphore.core.calls import extend_call
from celery_semaphore.core.semaphore import guard
from celery_semaphore.testing import RedisServer

TRIVIAL = "return 1"
MINIMAL_ACQUIRE = """
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
  return 1
end
return 0
"""
SEED_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
"""A pair with the semantics of the leased semaphore we build from: the server's clock, a
prune of lapsed holders, the count, the add and the key's expiry; release by ZREM. Ours
adds holder metadata, live limits, the waiting room's check and an answer of whether the
slot was still ours."""
BATCH = 100  # slots per batched extend in the server section
MINIMAL_RELEASE = "return redis.call('ZREM', KEYS[1], ARGV[1])"


def _spread(values: list[float], fmt: str = "{:.0f}") -> str:
    middle, low, high = (fmt.format(v) for v in (statistics.median(values), *_ends(values)))
    return f"{middle} ({low}-{high})"


def _ends(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def _rate(pair: Callable[[], object], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        pair()
    return n / (time.perf_counter() - started)


def pairs(args: argparse.Namespace, console: Console) -> None:
    with RedisServer() as server:
        client = server.client()
        trivial = client.register_script(TRIVIAL)
        sem = Semaphore(client, limit=10, lease=60.0)
        # The release thread is slower than the acquires: a limit they never reach.
        later = Semaphore(server.client(), limit=1_000_000, lease=60.0)
        lock = client.lock("bench:lock", timeout=60)
        prl = redis_lock.Lock(client, "bench:prl", expire=60)

        def anchor() -> None:
            trivial(keys=["bench:k"], args=[1])
            trivial(keys=["bench:k"], args=[1])

        def ours() -> None:
            slot = sem.acquire("bench")
            assert slot is not None
            slot.release()

        def ours_later() -> None:
            with guard(later.acquire("bench"), None, later=True):  # type: ignore[type-var]
                pass

        plan = sem._plan.acquire("bench", None, 1, None, 0, 0.1, None, 0.0, None)
        scripts, bare_keys, member = sem._scripts, plan.keys, plan.token

        def bare() -> None:
            scripts.acquire(bare_keys, 10, 60_000, member)
            scripts.release(bare_keys, member, 1000)

        def redis_py_lock() -> None:
            assert lock.acquire(blocking=False)
            lock.release()

        def python_redis_lock() -> None:
            assert prl.acquire(blocking=False)
            prl.release()

        setups = {
            "two EVALSHA of a trivial script (the limit)": anchor,
            "celery-semaphore acquire + release": ours,
            "the same, release handed to the release thread (a threads pool's run)": ours_later,
            "its two scripts alone, sent bare (the floor under the pair)": bare,
            "redis-py Lock acquire + release": redis_py_lock,
            "python-redis-lock acquire + release": python_redis_lock,
        }
        if args.against:
            old = _older(args.against).Semaphore(client, limit=10, lease=60.0, prefix="older")

            def older() -> None:
                slot = old.acquire("bench")
                assert slot is not None
                slot.release()

            setups[f"celery-semaphore at {args.against}"] = older
        for pair in setups.values():
            _rate(pair, 200)  # load the scripts, warm the connection
        rates: dict[str, list[float]] = {name: [] for name in setups}
        ratios: dict[str, list[float]] = {name: [] for name in setups}
        chunk = 100  # setups take turns every 100 pairs, so drift hits them alike
        for _ in range(args.rounds):
            spent = dict.fromkeys(setups, 0.0)
            for _ in range(max(1, args.pairs // chunk)):
                for name, pair in setups.items():
                    spent[name] += chunk / _rate(pair, chunk)
            done = max(1, args.pairs // chunk) * chunk
            limit = done / spent[next(iter(setups))]
            for name in setups:
                rates[name].append(done / spent[name])
                ratios[name].append(done / spent[name] / limit)
    title = f"Uncontended pairs/s, one client, {args.rounds} rounds of {args.pairs}"
    _pairs_table(console, title, rates, ratios)


def _older(directory: str) -> Any:
    """The ``celery_semaphore`` package in ``directory``, copied and imported as
    ``celery_semaphore_older`` (its modules import each other relatively)."""
    copy = Path(tempfile.mkdtemp()) / "celery_semaphore_older"
    shutil.copytree(Path(directory) / "celery_semaphore", copy)
    sys.path.insert(0, str(copy.parent))
    return importlib.import_module("celery_semaphore_older")


def _pairs_table(
    console: Console, title: str, rates: dict[str, list[float]], ratios: dict[str, list[float]]
) -> None:
    table = Table(title=title)
    for column in ("setup", "pairs/s", "ratio to the limit"):
        table.add_column(column)
    for name in rates:
        table.add_row(name, _spread(rates[name]), _spread(ratios[name], "{:.2f}"))
    console.print(table)


async def _async_rate(pair: Callable[[], Awaitable[object]], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        await pair()
    return n / (time.perf_counter() - started)


async def _async_pairs(port: int, args: argparse.Namespace) -> tuple[dict[str, list[float]], ...]:
    client = aioredis.Redis(host="127.0.0.1", port=port)
    trivial = client.register_script(TRIVIAL)
    sem = AsyncSemaphore(client, limit=10, lease=60.0)

    async def anchor() -> None:
        await trivial(keys=["bench:k"], args=[1])
        await trivial(keys=["bench:k"], args=[1])

    async def ours() -> None:
        slot = await sem.acquire("bench")
        assert slot is not None
        await slot.release()

    setups = {
        "two async EVALSHA of a trivial script (the limit)": anchor,
        "AsyncSemaphore acquire + release": ours,
    }
    for pair in setups.values():
        await _async_rate(pair, 200)  # load the scripts, warm the connection
    rates: dict[str, list[float]] = {name: [] for name in setups}
    ratios: dict[str, list[float]] = {name: [] for name in setups}
    chunk = 100  # setups take turns every 100 pairs, so drift hits them alike
    for _ in range(args.rounds):
        spent = dict.fromkeys(setups, 0.0)
        for _ in range(max(1, args.pairs // chunk)):
            for name, pair in setups.items():
                spent[name] += chunk / await _async_rate(pair, chunk)
        done = max(1, args.pairs // chunk) * chunk
        limit = done / spent[next(iter(setups))]
        for name in setups:
            rates[name].append(done / spent[name])
            ratios[name].append(done / spent[name] / limit)
    await client.aclose()
    return rates, ratios


def async_pairs(args: argparse.Namespace, console: Console) -> None:
    with RedisServer() as server:
        rates, ratios = asyncio.run(_async_pairs(server.port, args))
    title = f"Uncontended async pairs/s, one asyncio client, {args.rounds} rounds of {args.pairs}"
    _pairs_table(console, title, rates, ratios)


def _evalsha_stats(client: redis.Redis) -> tuple[int, float]:
    found = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(found.get("calls", 0)), float(found.get("usec", 0))


def renewal(args: argparse.Namespace, console: Console) -> None:
    table = Table(title="Renewal: lease 2 s, renewed every 0.5 s, for 3 s")
    for column in ("slots held", "round trips per tick", "renewal threads", "all threads"):
        table.add_column(column)
    with RedisServer() as server:
        client = server.client()
        for count in (1, 10, 100, 1000):
            sem = Semaphore(server.url, limit=count, lease=2.0)
            with contextlib.ExitStack() as stack:
                for _ in range(count):
                    stack.enter_context(sem.hold(f"renew-{count}", heartbeat=0.5))
                client.config_resetstat()
                time.sleep(3.0)
                calls, _ = _evalsha_stats(client)
                renewers = len(heartbeat.threads())
                total = threading.active_count()
            table.add_row(str(count), f"{calls / 6:.1f}", str(renewers), str(total))
            sem.client.close()
    console.print(table)


def release_gap(args: argparse.Namespace, console: Console) -> None:
    """How long after a run's end its release, sent later, is in: from leaving the guard to
    the slot's release answered (milliseconds), one run at a time, the runner idle meanwhile
    (it sleeps 0.1 ms at a time, as a worker waiting for its next message would)."""
    gaps = []
    with RedisServer() as server:
        sem = Semaphore(server.client(), limit=10, lease=60.0)
        for _ in range(max(100, args.pairs // 10)):
            slot = sem.acquire("gap")
            assert slot is not None
            ended = time.perf_counter()
            with guard(slot, None, later=True):
                ended = time.perf_counter()
            while not slot.released:
                time.sleep(0.0001)
            gaps.append((time.perf_counter() - ended) * 1000)
    qs = statistics.quantiles(gaps, n=100)
    console.print(f"Release gap, ms, {len(gaps)} runs: median {statistics.median(gaps):.2f}, "
                  f"p90 {qs[89]:.2f}, p99 {qs[98]:.2f}, max {max(gaps):.2f}")  # fmt: skip


def server(args: argparse.Namespace, console: Console) -> None:
    n = args.pairs
    with RedisServer() as srv:
        client = srv.client()
        minimal_acquire = client.register_script(MINIMAL_ACQUIRE)
        minimal_release = client.register_script(MINIMAL_RELEASE)
        seed_acquire = client.register_script(SEED_ACQUIRE)
        sem = Semaphore(client, limit=n + 40, lease=60.0)
        sem.count("warm")

        def usec(run: Callable[[], Any]) -> float:
            client.config_resetstat()
            run()
            calls, total = _evalsha_stats(client)
            return total / calls

        costs: dict[str, list[float]] = {
            k: []
            for k in (
                "acquire",
                "extend",
                "release",
                "min-acquire",
                "min-release",
                "seed-acquire",
                "seed-release",
            )
        }
        for _ in range(args.rounds):
            # About 40 holders on the key while measuring, as a busy key would have.
            base = [sem.acquire("cost") for _ in range(40)]
            slots: list[Any] = []

            def take(into: list[Any] = slots) -> None:
                into.extend(sem.acquire("cost") for _ in range(n))

            costs["acquire"].append(usec(take))
            renewals = [(s._keys, s._member, 60_000, 1) for s in slots if s is not None]

            def renew(rows: list[Any] = renewals) -> None:
                for i in range(0, len(rows), BATCH):
                    sem._scripts.run(extend_call(rows[i : i + BATCH]))

            costs["extend"].append(usec(renew) / BATCH)

            def give_back(held: list[Any] = slots) -> None:
                for slot in held:
                    slot.release()

            costs["release"].append(usec(give_back))
            for s in base:
                assert s is not None
                s.release()
            for i in range(40):
                minimal_acquire(keys=["min"], args=[n + 40, 1, f"b{i}"])

            def minimal_take() -> None:
                for i in range(n):
                    minimal_acquire(keys=["min"], args=[n + 40, 1, f"t{i}"])

            def minimal_give_back() -> None:
                for i in range(n):
                    minimal_release(keys=["min"], args=[f"t{i}"])

            costs["min-acquire"].append(usec(minimal_take))
            costs["min-release"].append(usec(minimal_give_back))
            client.delete("min")
            for i in range(40):
                seed_acquire(keys=["seed"], args=[n + 40, 60_000, f"b{i}"])

            def seed_take() -> None:
                for i in range(n):
                    seed_acquire(keys=["seed"], args=[n + 40, 60_000, f"t{i}"])

            def seed_give_back() -> None:
                for i in range(n):
                    minimal_release(keys=["seed"], args=[f"t{i}"])

            costs["seed-acquire"].append(usec(seed_take))
            costs["seed-release"].append(usec(seed_give_back))
            client.delete("seed")
    table = Table(title="Redis microseconds per script call (INFO commandstats), ~40 holders")
    for column in ("script", "usec/call", "vs minimal"):
        table.add_column(column)
    pair = [a + r for a, r in zip(costs["acquire"], costs["release"], strict=True)]
    minimal = [a + r for a, r in zip(costs["min-acquire"], costs["min-release"], strict=True)]
    for name in ("acquire", "extend", "release"):
        anchor = costs["min-release" if name == "release" else "min-acquire"]
        versus = [c / a for c, a in zip(costs[name], anchor, strict=True)]
        table.add_row(name, _spread(costs[name], "{:.1f}"), _spread(versus, "{:.2f}"))
    versus = [p / m for p, m in zip(pair, minimal, strict=True)]
    table.add_row("acquire + release", _spread(pair, "{:.1f}"), _spread(versus, "{:.2f}"))
    table.add_row("minimal pair", _spread(minimal, "{:.1f}"), "1.00")
    seed = [a + r for a, r in zip(costs["seed-acquire"], costs["seed-release"], strict=True)]
    versus = [p / s for p, s in zip(pair, seed, strict=True)]
    table.add_row(
        "seed-semantics pair",
        _spread(seed, "{:.1f}"),
        _spread([s / m for s, m in zip(seed, minimal, strict=True)], "{:.2f}"),
    )
    table.add_row("acquire + release vs the seed pair", "", _spread(versus, "{:.2f}"))
    console.print(table)
    console.print(f"Ceiling for one key: {1e6 / statistics.median(pair):,.0f} pairs/s "
                  f"(minimal pair: {1e6 / statistics.median(minimal):,.0f})")  # fmt: skip


SECTIONS = {"pairs": pairs, "async-pairs": async_pairs, "renewal": renewal, "server": server,
            "release-gap": release_gap}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sections", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--against", metavar="DIR", help="an older celery_semaphore's parent")
    args = parser.parse_args()
    console = Console(width=120)
    for name in args.sections:
        SECTIONS[name](args, console)


if __name__ == "__main__":
    main()
