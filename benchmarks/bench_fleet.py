"""The waiting room at fleet scale (issue 23): what a big, still room costs the store and
the workers when nothing changes.

    python benchmarks/bench_fleet.py [--n 10000 ...] [--rooms 1000 ...] [--workers 1 4 ...]
                                     [--seconds 10] [--warmup 5] [--rounds 1]
                                     [--pool prefork] [--concurrency 2] [--full]

Each cell is one store (a private redis-server holding only the semaphore's keys) with one
room of N parked runs on key ``fleet`` and R rooms of one parked run each on keys
``tenant:<i>``, every key's one slot (limit 1) held by this benchmark with a long lease, so
nothing drains. The rooms are written with the library's own ``WaitingRoom.park``, each
payload being ``payload_of``'s message for a run of ``fleet_app.parked`` (as the glue parks
it) with the run's own id. W ``celery worker`` processes of ``fleet_app`` (a separate
``celery worker`` command each, ``-P prefork -c 2`` by default) run against that store, with
a second private redis-server as their broker, result backend and the place this benchmark's
timings are written (so the store sees only the library and the measurements below). After
the workers answer a ping and ``--warmup`` seconds, a window of ``--seconds`` in which
nothing changes measures:

* **store CPU**: the store's ``used_cpu_sys + used_cpu_user`` (``INFO cpu``) over the window,
  as a share of one core;
* **longest command**: the longest in the store's slow log over the window (threshold
  ``--slowlog-us``, read and emptied every second, so none is lost to its length), which
  command and script (an EVALSHA is named by its script and first key); the benchmark's own
  INFO, SLOWLOG, CONFIG and PING are left out;
* **PING p99**: a separate process PINGs the store every 10 ms on its own connection (a
  PING that times out, after 2 s, counts as 2 s). A PING that waits L ms also stands for the
  PINGs due every 10 ms meanwhile, which would have waited L - 10, L - 20, ... ms: without
  them a store that stalls for a second would be one sample of hundreds (coordinated
  omission);
* **unbounded start p99**: every 100 ms this process sends ``fleet_unbounded`` (no
  semaphore) to the same workers, its argument the ``time.monotonic()`` of the send; its
  body records when it started, so the latency is send to body start, including the time the
  message waits while a worker's main process is busy sweeping. The consumer's
  ``task_received`` is recorded too (received to start: the pool's share alone). A task not
  started ``--drain`` seconds after the window counts as never started (infinite);
* the sweeps of the big room in the window that took over ``--slowlog-us`` (the slow log
  holds no others) and the longest: a worker
  sweeps the rooms one after another, so with many rooms its pass over them all may outlast
  the window, and a window with no sweep of the big room in it misses its cost;
* worker main processes' CPU (utime + stime from ``/proc``, summed over the W workers, as a
  share of one core), and script calls per second on the store.

Redis 7 also logs the commands a script calls, so the slow log names what inside a slow
script was slow (a single command there over 5 ms is the store's process kept off the CPU,
on a busy machine).

The targets (issue 23), printed as PASS/FAIL for every cell: store CPU < 5 %, no command
over 5 ms, PING p99 < 5 ms, unbounded start p99 < 250 ms, at N = 50k, R = 10k, W = 8; and each
figure flat within 2x as N, R and W grow: the flatness table divides each cell's figure by
the smallest cell's (the anchor, measured in the same run), each figure first raised to a
floor of a tenth of its target, so that noise on a figure far below its target is not read
as growth. Each round visits every cell (rotating the order), with the stores built once and
kept; figures are the median (min-max) over rounds, the longest command the max.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry
from rich.console import Console
from rich.table import Table

from celery_semaphore import Semaphore
from celery_semaphore.core.scripts import Scripts
from celery_semaphore.testing import RedisServer

HERE = Path(__file__).resolve().parent
TARGETS = {"cpu": 5.0, "command_ms": 5.0, "ping_ms": 5.0, "start_ms": 250.0}
REFERENCE = (50_000, 10_000, 8)  # the cell the issue states its targets at: N, R, W
HOLD = 24 * 3600.0  # lease of the slots the benchmark holds: longer than any run
LOG_LENGTH = 4096  # the store's slowlog-max-len
OWN_COMMANDS = {"info", "slowlog", "config", "ping", "client", "hello"}
TIMEOUT = 10.0  # seconds any one store or broker command of this benchmark may take
PING_EVERY, PING_TIMEOUT = 0.01, 2.0
DEBUG = bool(os.environ.get("BENCH_DEBUG"))
"""Print the store's commands over each window (see _print_commands)."""
SEND_EVERY = 0.1


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


# --- the store ------------------------------------------------------------------------------


@dataclass
class Store:
    """A private redis-server holding one room of ``n`` parked runs and ``rooms`` rooms of
    one, every key's slot held."""

    n: int
    rooms: int
    server: RedisServer
    memory: str = ""
    built_in: float = 0.0
    scripts: dict[str, str] = field(default_factory=dict)  # sha -> script name


def _payload_template(broker_url: str, store_url: str) -> tuple[bytes, str]:
    """``payload_of``'s message for a run of ``fleet_app.parked``, and the id in it (each
    parked run gets its own in its place)."""
    os.environ.setdefault("BENCH_BROKER_URL", broker_url)
    os.environ.setdefault("BENCH_SEMAPHORE_URL", store_url)
    sys.path.insert(0, str(HERE))
    import fleet_app

    from celery_semaphore.integration.waiting_room.parking import payload_of

    task, task_id = fleet_app.parked, str(uuid.uuid4())
    task.push_request(id=task_id, args=["fleet", 0], kwargs={}, retries=0, headers={},
                      delivery_info={"exchange": "", "routing_key": "celery"})  # fmt: skip
    try:
        # The headers a parked run carries (the retry's and the room's own).
        headers = {"semaphore_handoff": 0, "semaphore_first_shed": time.time(),
                   "semaphore_shed_attempt": 0}  # fmt: skip
        return payload_of(task, task.request, headers), task_id
    finally:
        task.pop_request()


def build_store(n: int, rooms: int, slowlog_us: int, broker_url: str) -> Store:
    """Start a store and fill it (see :class:`Store`); prints its progress to stderr."""
    log = ("--slowlog-log-slower-than", str(slowlog_us), "--slowlog-max-len", str(LOG_LENGTH))
    server = RedisServer(extra_args=log).start()
    started = time.monotonic()
    template, template_id = _payload_template(broker_url, server.url)
    client = server.client(socket_timeout=TIMEOUT)
    sem = Semaphore(client, limit=1, lease=HOLD)

    def park(key: str) -> None:
        waiter = str(uuid.uuid4())
        parked = sem.room.park(key, waiter, template.replace(template_id.encode(),
                               waiter.encode()), limit=1)  # fmt: skip
        assert type(parked).__name__ == "Parked", parked

    assert sem.acquire("fleet", lease=HOLD) is not None
    for i in range(n):
        park("fleet")
        if i % 10_000 == 9_999:
            print(f"  store N={n} R={rooms}: {i + 1} parked", file=sys.stderr, flush=True)
    for i in range(rooms):
        assert sem.acquire(f"tenant:{i}", lease=HOLD) is not None
        park(f"tenant:{i}")
    memory = client.info("memory")["used_memory_human"]
    names = {script.sha: name for name, script in Scripts(client)._scripts.items()}
    client.close()
    return Store(n, rooms, server, memory, time.monotonic() - started, names)


# --- the workers ----------------------------------------------------------------------------


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(workers: list[subprocess.Popen[bytes]], grace: float = 20.0) -> None:
    """SIGTERM every worker, then SIGKILL the process group of any still there after
    ``grace`` seconds (a main process stuck in a sweep of a slow store, say)."""
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for worker in workers:
        try:
            worker.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):  # pool processes left behind
            os.killpg(worker.pid, signal.SIGKILL)


@contextlib.contextmanager
def fleet(
    broker_url: str, store_url: str, count: int, args: argparse.Namespace, log: Path
) -> Iterator[tuple[Celery, list[int]]]:
    """Start ``count`` ``celery worker`` processes of ``fleet_app``, wait until each answers
    a ping (at most ``--start-timeout`` seconds), and yield a client app on the broker and
    the workers' main pids. Their stderr goes to ``log``."""
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    environ = {**os.environ, "BENCH_BROKER_URL": broker_url, "BENCH_SEMAPHORE_URL": store_url,
               "PYTHONPATH": path}  # fmt: skip
    host = socket.gethostname()
    workers: list[subprocess.Popen[bytes]] = []
    # No result backend: Redis's would subscribe to every task's result as it is sent.
    app = Celery("fleet-client", broker=broker_url, set_as_current=False)
    app.conf.broker_connection_timeout = 5
    app.conf.broker_transport_options = {"socket_timeout": TIMEOUT, "socket_connect_timeout": 5}
    with log.open("wb") as err:
        try:
            for i in range(count):
                command = [sys.executable, "-m", "celery", "-A", "fleet_app", "worker",
                           "-P", args.pool, "-c", str(args.concurrency), "-n", f"fleet{i}@{host}",
                           "--loglevel=WARNING", "--without-gossip", "--without-mingle",
                           "--without-heartbeat"]  # fmt: skip
                workers.append(subprocess.Popen(
                    command, cwd=HERE, env=environ, stdout=subprocess.DEVNULL, stderr=err,
                    start_new_session=True, preexec_fn=_die_with_parent,
                ))  # fmt: skip
            deadline = time.monotonic() + args.start_timeout
            answered: set[str] = set()
            while len(answered) < count:
                if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                    raise RuntimeError(f"{count - len(answered)} of {count} workers did not "
                                       f"start (see {log})")  # fmt: skip
                with contextlib.suppress(Exception):
                    for reply in app.control.ping(timeout=1.0) or []:
                        answered.update(reply)
            yield app, [w.pid for w in workers]
        finally:
            app.close()
            _stop(workers)


def _cpu_seconds(pids: list[int]) -> float:
    """utime + stime of ``pids`` (not their children), seconds; a gone process counts 0."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / ticks


# --- the measurements -----------------------------------------------------------------------


def _pinger(port: int, most: float, line: Connection) -> None:
    """PING 127.0.0.1:``port`` every 10 ms from when it says "ready" on ``line`` until it is
    told to stop there (or ``most`` seconds pass); then send back the latencies (ms) and how
    many timed out. Runs in its own process, so this benchmark's own threads never hold it
    up."""
    # No retries: redis-py's default would send a PING that timed out again, and hide it.
    client = redis.Redis(port=port, retry=Retry(NoBackoff(), 0), socket_timeout=PING_TIMEOUT,
                         socket_connect_timeout=PING_TIMEOUT)  # fmt: skip
    latencies: list[float] = []
    lost = 0
    line.send("ready")
    due = time.monotonic()
    end = due + most
    every = PING_EVERY * 1000
    while due < end and not line.poll():
        started = time.perf_counter()
        try:
            client.ping()
            took = (time.perf_counter() - started) * 1000
        except redis.RedisError:
            lost += 1
            took = PING_TIMEOUT * 1000
        # The PINGs due while this one waited were not sent (one connection waits for its
        # answer), but a client sending every 10 ms would have sent them, and each would have
        # waited for the rest of the same stall: count them, or a stall of the store would be
        # one sample however long it lasts (coordinated omission).
        while took > 0:
            latencies.append(took)
            took -= every
        due = max(due + PING_EVERY, time.monotonic())
        time.sleep(max(0.0, due - time.monotonic()))
    line.send((latencies, lost))
    line.close()


class SlowLog:
    """The store's slow log over a window, read and emptied every second, so that none is
    lost to its length; :meth:`longest` is the longest entry not of this benchmark."""

    def __init__(self, client: redis.Redis, scripts: dict[str, str]) -> None:
        self.client, self.scripts = client, scripts
        self.entries: dict[int, tuple[int, str]] = {}  # id -> (microseconds, command)
        self.failed = 0  # reads that failed (a store too slow to answer in TIMEOUT)
        self.lost = False
        client.slowlog_reset()

    def _name(self, command: list[str]) -> str:
        verb = command[0].lower() if command else "?"
        if verb == "evalsha" and len(command) > 3:
            return f"EVALSHA {self.scripts.get(command[1], command[1][:8])} {command[3]}"
        return " ".join(command[:2])

    def read(self) -> None:
        """Take the entries logged since the last read, and empty the log (one transaction,
        so none is lost between the two; each read returns only what is new, which keeps
        this benchmark's own cost on the store small)."""
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.slowlog_get(LOG_LENGTH)
                pipe.slowlog_reset()
                raw, _ = pipe.execute()
        except redis.RedisError:
            self.failed += 1
            return
        self.lost = self.lost or len(raw) >= LOG_LENGTH  # the log may have dropped some
        for entry in raw:
            # redis-py gives each entry's command as its words joined by spaces.
            command = _text(entry["command"]).split(" ", 4)
            if command and command[0].lower() not in OWN_COMMANDS:
                self.entries[int(entry["id"])] = (int(entry["duration"]), self._name(command))

    def longest(self) -> tuple[int, str]:
        return max(self.entries.values(), default=(0, "none over the threshold"))

    def named(self, name: str) -> tuple[int, int]:
        """How many entries are ``name``, and the longest of them (µs)."""
        found = [m for m, n in self.entries.values() if n == name]
        return len(found), max(found, default=0)

    def over(self, micros: int) -> str:
        """How many took longer than ``micros``, and which (the two most frequent)."""
        found = Counter(name for m, name in self.entries.values() if m > micros)
        if not found:
            return "0"
        which = ", ".join(f"{count} {name}" for name, count in found.most_common(2))
        more = " ..." if len(found) > 2 else ""
        return f"{sum(found.values())}: {which}{more}"


def _stall(server: RedisServer, seconds: float) -> threading.Thread:
    """Freeze the store (SIGSTOP) for ``seconds`` from now, in a thread: ``--stall``, which
    checks that the benchmark's waits are bounded when the store stops answering."""

    def freeze() -> None:
        server.pause()
        try:
            time.sleep(seconds)
        finally:
            server.resume()

    thread = threading.Thread(target=freeze, daemon=True)
    thread.start()
    return thread


def p99(values: list[float]) -> float:
    """The 99th percentile, nearest rank (inf counts as the largest)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _print_commands(before: dict[str, Any], after: dict[str, Any], wall: float) -> None:
    """BENCH_DEBUG=1: the store's commands over the window by server time, most first
    (a script's own commands are counted apart from its EVALSHA, on Redis 7)."""
    rows = []
    for name, stat in after.items():
        old = before.get(name, {"calls": 0, "usec": 0})
        calls, usec = stat["calls"] - old["calls"], stat["usec"] - old["usec"]
        if calls:
            rows.append((usec, calls, name.removeprefix("cmdstat_")))
    for usec, calls, name in sorted(rows, reverse=True)[:12]:
        print(
            f"  {name:24} {calls / wall:9.1f}/s {usec / wall / 1e4:6.2f}% of a core "
            f"{usec / calls:8.1f} us/call",
            file=sys.stderr,
        )


def _store_stats(client: redis.Redis) -> tuple[float, int, int] | None:
    """The store's CPU seconds, script calls and all calls so far; None if it did not
    answer within TIMEOUT."""
    try:
        cpu = client.info("cpu")
        stats = client.info("commandstats")
    except redis.RedisError:
        return None
    scripts = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    return (
        cpu["used_cpu_sys"] + cpu["used_cpu_user"],
        scripts,
        sum(v["calls"] for v in stats.values()),
    )


def measure(store: Store, broker: RedisServer, workers: int, args: argparse.Namespace) -> dict[
    str, Any
]:  # fmt: skip
    """One cell: ``workers`` workers on ``store`` for the warm-up and the window."""
    client = store.server.client(socket_timeout=TIMEOUT)
    records = broker.client(socket_timeout=TIMEOUT)
    records.flushdb()
    log = Path(args.logs) / f"fleet-N{store.n}-R{store.rooms}-W{workers}.log"
    with fleet(broker.url, store.server.url, workers, args, log) as (app, pids):
        time.sleep(args.warmup)
        context = multiprocessing.get_context("spawn")
        line, far_end = context.Pipe()
        most = args.seconds + 60
        pinger = context.Process(target=_pinger, args=(store.server.port, most, far_end))
        pinger.start()
        if not line.poll(60) or line.recv() != "ready":
            raise RuntimeError("the PING process did not start")
        slowlog = SlowLog(client, store.scripts)
        before, cpu_before = _store_stats(client), _cpu_seconds(pids)
        commands_before = client.info("commandstats") if DEBUG else {}
        started = time.monotonic()
        sent: dict[str, float] = {}
        stalled = None
        due, next_read = started, started + 1.0
        while due < started + args.seconds:
            now = time.monotonic()
            with contextlib.suppress(Exception):  # a broker hiccup costs one sample
                result = app.send_task("fleet_unbounded", (now,))
                sent[result.id] = now
            if now >= next_read:
                slowlog.read()
                next_read += 1.0
            if args.stall and not stalled and now >= started + args.seconds / 2:
                stalled = _stall(store.server, args.stall)
            # A late tick (a slow-log read of a store too slow to answer) skips its sends
            # rather than send a burst.
            due = max(due + SEND_EVERY, time.monotonic())
            time.sleep(max(0.0, due - time.monotonic()))
        if stalled is not None:
            stalled.join(timeout=args.stall + 5)
        slowlog.read()
        after, cpu_after = _store_stats(client), _cpu_seconds(pids)
        wall = time.monotonic() - started
        if DEBUG:
            _print_commands(commands_before, client.info("commandstats"), wall)
        line.send("stop")
        latencies, timeouts = [], 0
        if line.poll(PING_TIMEOUT + 10):
            latencies, timeouts = line.recv()
        pinger.join(timeout=5)
        if pinger.is_alive():
            pinger.kill()
        # Wait (bounded) for the unbounded tasks sent in the window to start.
        deadline = time.monotonic() + args.drain
        while records.llen("bench:starts") < len(sent) and time.monotonic() < deadline:
            time.sleep(0.1)
        starts = {}
        for raw in records.lrange("bench:starts", 0, -1):
            task_id, _, at = _text(raw).split()
            starts[task_id] = float(at)
        received = {_text(k): float(v) for k, v in records.hgetall("bench:received").items()}
    warnings = log.read_text(errors="replace").count("could not sweep") if log.exists() else 0
    waits = [(starts[t] - s) * 1000 if t in starts else math.inf for t, s in sent.items()]
    pool = [(starts[t] - received[t]) * 1000 for t in sent if t in starts and t in received]
    longest_us, longest_name = slowlog.longest()
    big_sweeps, big_sweep_us = slowlog.named("EVALSHA sweep semaphore:{fleet}")
    row: dict[str, Any] = {
        "cpu": math.nan,
        "scripts_s": math.nan,
        "calls_s": math.nan,
        "command_ms": longest_us / 1000,
        "command": longest_name,
        "over_5ms": slowlog.over(5000),
        "big_sweeps": f"{big_sweeps} ({big_sweep_us / 1000:.0f} ms)",
        "error": "; ".join(
            ([f"{slowlog.failed} slow-log reads failed"] if slowlog.failed else [])
            + (["the slow log was full at a read: entries may be missing"] if slowlog.lost else [])
        ),
        "ping_ms": p99(latencies),
        "ping_timeouts": timeouts,
        "ping_max_ms": max(latencies, default=math.nan),
        "start_ms": p99(waits),
        "pool_ms": p99(pool),
        "started": sum(w != math.inf for w in waits),
        "sent": len(sent),
        "worker_cpu": (cpu_after - cpu_before) / wall * 100,
        "sweep_warnings": warnings,
    }
    if before is not None and after is not None:
        row["cpu"] = (after[0] - before[0]) / wall * 100
        row["scripts_s"] = (after[1] - before[1]) / wall
        row["calls_s"] = (after[2] - before[2]) / wall
    client.close()
    records.close()
    return row


def _lost(exc: BaseException) -> dict[str, Any]:
    """The row of a cell that could not be measured."""
    row: dict[str, Any] = dict.fromkeys(
        (*TARGETS, "scripts_s", "worker_cpu", "pool_ms", "ping_max_ms"), math.nan
    )
    row.update(command="-", over_5ms="-", big_sweeps="-", started=0, sent=0, ping_timeouts=0,
               sweep_warnings=0, error=f"{type(exc).__name__}: {exc}")  # fmt: skip
    return row


# --- the tables -----------------------------------------------------------------------------


def _spread(values: list[float], fmt: str) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "n/a"
    middle = statistics.median(finite)
    return f"{_num(middle, fmt)} ({_num(min(finite), fmt)}-{_num(max(finite), fmt)})"


def _num(value: float, fmt: str) -> str:
    return "inf" if math.isinf(value) else fmt.format(value)


def _verdict(value: float, target: float) -> str:
    if math.isnan(value):
        return "n/a"
    return "PASS" if value < target else "FAIL"


def _figure(runs: list[dict[str, Any]], name: str) -> float:
    """The cell's figure: the median over rounds, the longest command's max."""
    values = [float(r[name]) for r in runs if not math.isnan(r[name])]
    if not values:
        return math.nan
    return max(values) if name == "command_ms" else statistics.median(values)


class Tables:
    """Rows for a rich table and, with ``--markdown``, the same as a Markdown table."""

    def __init__(self, console: Console, markdown: bool) -> None:
        self.console, self.markdown = console, markdown

    def show(self, title: str, columns: list[str], rows: list[list[str]]) -> None:
        table = Table(title=title)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        self.console.print(table)
        if self.markdown:
            print(f"\n{title}:\n")
            print("| " + " | ".join(columns) + " |")
            print("|" + "---|" * len(columns))
            for row in rows:
                print("| " + " | ".join(row) + " |")
            print()


def report(cells: dict[tuple[int, int, int], list[dict[str, Any]]], args: argparse.Namespace,
           tables: Tables) -> None:  # fmt: skip
    about = (f"{args.pool} workers -c {args.concurrency}, a {args.seconds:g} s window after "
             f"{args.warmup:g} s; {args.rounds} round(s), interleaved")  # fmt: skip
    rows, extras = [], []
    for (n, rooms, workers), runs in cells.items():
        cell = [f"{n:,}", f"{rooms:,}", str(workers)]
        worst = max(runs, key=lambda r: -1 if math.isnan(r["command_ms"]) else r["command_ms"])
        rows.append([
            *cell,
            _spread([r["cpu"] for r in runs], "{:.1f}"),
            _verdict(_figure(runs, "cpu"), TARGETS["cpu"]),
            _num(worst["command_ms"] * 1000, "{:,.0f}"),
            _verdict(_figure(runs, "command_ms"), TARGETS["command_ms"]),
            _spread([r["ping_ms"] for r in runs], "{:.2f}"),
            _verdict(_figure(runs, "ping_ms"), TARGETS["ping_ms"]),
            _spread([r["start_ms"] for r in runs], "{:.0f}"),
            _verdict(_figure(runs, "start_ms"), TARGETS["start_ms"]),
        ])  # fmt: skip
        extras.append([
            *cell,
            worst["command"],
            " / ".join(r["big_sweeps"] for r in runs),
            " / ".join(str(r["over_5ms"]) for r in runs),
            _spread([r["scripts_s"] for r in runs], "{:.0f}"),
            _spread([r["worker_cpu"] for r in runs], "{:.0f}"),
            _spread([r["pool_ms"] for r in runs], "{:.0f}"),
            "/".join(f"{r['started']} of {r['sent']}" for r in runs),
            _spread([r["ping_max_ms"] for r in runs], "{:.0f}"),
            "/".join(f"{r['ping_timeouts']}" for r in runs),
            "/".join(str(r["sweep_warnings"]) for r in runs),
            "; ".join(r["error"] for r in runs if r.get("error")) or "-",
        ])  # fmt: skip
    tables.show(
        f"The waiting room at rest against issue 23's targets ({about}; median (min-max), "
        "the longest command the max)",
        ["N", "R", "W", "store CPU, % of a core", "< 5 %", "longest command, µs", "< 5 ms",
         "PING p99, ms", "< 5 ms", "unbounded start p99, ms", "< 250 ms"],
        rows,
    )  # fmt: skip
    tables.show(
        f"What else the window saw ({about})",
        ["N", "R", "W", "longest command", "slow sweeps of the big room (longest)",
         "slow-log entries over 5 ms", "store script calls/s",
         "workers' main CPU, % of a core", "received→start p99, ms", "unbounded started",
         "PING max, ms", "PING timeouts", "sweep warnings", "errors"],
        extras,
    )  # fmt: skip
    if REFERENCE in cells:
        runs = cells[REFERENCE]
        verdicts = [f"{name} {_verdict(_figure(runs, name), target)}"
                    for name, target in TARGETS.items()]  # fmt: skip
        print(f"Issue 23's cell (N=50k, R=10k, W=8): {', '.join(verdicts)}")
    else:
        print("Issue 23's cell (N=50k, R=10k, W=8) was not run: its targets are applied to "
              "every cell above.")  # fmt: skip
    anchor_cell = min(cells)
    flat = []
    for name, target in TARGETS.items():
        floor = target / 10
        anchor = _figure(cells[anchor_cell], name)
        ratios = {cell: max(_figure(runs, name), floor) / max(anchor, floor)
                  for cell, runs in cells.items()}  # fmt: skip
        worst_cell = max(ratios, key=lambda c: -1 if math.isnan(ratios[c]) else ratios[c])
        ratio = ratios[worst_cell]
        verdict = "n/a" if math.isnan(ratio) else ("PASS" if ratio <= 2 else "FAIL")
        figure = _figure(cells[worst_cell], name)
        flat.append([name, "/".join(map(str, anchor_cell)), _num(anchor, "{:.2f}"),
                     "/".join(map(str, worst_cell)), _num(figure, "{:.2f}"),
                     _num(ratio, "{:.1f}"), verdict])  # fmt: skip
    tables.show(
        "Flat within 2x as N, R, W grow: the worst cell's figure over the smallest cell's "
        "(each raised to a tenth of its target first)",
        ["figure", "anchor N/R/W", "anchor", "worst N/R/W", "worst", "ratio", "<= 2x"],
        flat,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10_000],
                        help="parked runs in the big room (default 10000)")  # fmt: skip
    parser.add_argument("--rooms", type=int, nargs="+", default=[1_000],
                        help="rooms of one parked run each (default 1000)")  # fmt: skip
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4],
                        help="worker processes (default 1 4)")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=10.0, help="the window (default 10)")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="seconds from the workers' start to the window")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pool", choices=("prefork", "threads"), default="prefork")
    parser.add_argument("--concurrency", type=int, default=2, help="-c of each worker")
    parser.add_argument("--slowlog-us", type=int, default=100,
                        help="the store's slowlog-log-slower-than (default 100)")  # fmt: skip
    parser.add_argument("--start-timeout", type=float, default=180.0,
                        help="seconds to wait for the workers to answer a ping")  # fmt: skip
    parser.add_argument("--drain", type=float, default=30.0,
                        help="seconds to wait for the window's tasks to start")  # fmt: skip
    parser.add_argument("--stall", type=float, default=0.0,
                        help="freeze the store (SIGSTOP) this many seconds mid-window: checks "
                             "that every wait is bounded (default 0: never)")  # fmt: skip
    parser.add_argument("--logs", default=tempfile.gettempdir(), help="where worker logs go")
    parser.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    parser.add_argument("--full", action="store_true",
                        help="issue 23's grid: --n 10000 50000 100000 --rooms 1000 10000 "
                             "--workers 1 4 8 --seconds 20 --rounds 2")  # fmt: skip
    args = parser.parse_args()
    if args.full:
        args.n, args.rooms, args.workers = [10_000, 50_000, 100_000], [1_000, 10_000], [1, 4, 8]
        args.seconds, args.rounds = 20.0, max(args.rounds, 2)
    tables = Tables(Console(width=200), args.markdown)
    cells: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(RedisServer())
        stores = {}
        for n in args.n:
            for rooms in args.rooms:
                store = build_store(n, rooms, args.slowlog_us, broker.url)
                stack.callback(store.server.close)
                stores[n, rooms] = store
                print(f"store N={n} R={rooms}: built in {store.built_in:.0f} s, "
                      f"{store.memory}", file=sys.stderr, flush=True)  # fmt: skip
        order = [(n, r, w) for (n, r) in stores for w in args.workers]
        cells = {cell: [] for cell in order}
        for round_ in range(args.rounds):
            shift = round_ % len(order)
            for n, rooms, workers in order[shift:] + order[:shift]:
                try:
                    row = measure(stores[n, rooms], broker, workers, args)
                except (RuntimeError, redis.RedisError, OSError) as exc:  # the cell is lost
                    row = _lost(exc)
                cells[n, rooms, workers].append(row)
                print(f"N={n} R={rooms} W={workers}: {row}", file=sys.stderr, flush=True)
    report(cells, args, tables)


if __name__ == "__main__":
    main()
