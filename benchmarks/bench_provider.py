"""A provider with a concurrency limit of its own, and the limits a fleet can put in front of it
(issue 35): a fixed limit above the provider's, the provider's own (the oracle), half of it,
and an adaptive limit that backs off on 429s.

    python benchmarks/bench_provider.py [--rounds 3] [--quick] [--setups NAME ...]
                                        [--tasks 600] [--changing-tasks 1400]
                                        [--changing-with adaptive] [--timeline]

**The provider** is a simulator, a real HTTP server on 127.0.0.1 (a free port) in a process
of its own: it admits at most C requests at once, each held ``--duration`` seconds, and
answers 429 with ``Retry-After: 1`` at once to a request that arrives while C are in
flight. C follows a schedule (seconds from the first request). It records every request
itself (arrival, admitted or 429, end), and every figure below comes from that record:
the makespan is the first arrival to the last admitted request's end; a 429 is a request
it refused; in flight is how many admitted requests it held at an instant.

**The fleet**: private redis-servers (one the broker and result backend, one the
semaphore's store) and two prefork workers (``-c 8`` each, so 16 processes) of
``provider_app``, fresh for every run. Each task makes one request (``httpx``) and succeeds,
or sees a 429 and then:

* ``fixed20``: ``limit=20`` (above the 16 processes: in effect unbounded); the run retries
  itself after the Retry-After (``self.retry(countdown=...)`` on a task with
  ``max_retries=None``), today's answer;
* ``oracle``: ``limit=C``, the same retry (it never sees a 429 while C holds still);
* ``half``: ``limit=C // 2``, the same retry;
* ``adaptive``: ``limit=Adaptive(initial=10, max=64)`` with ``back_off_on=(ProviderBusy,)``:
  a 429 raises ``ProviderBusy`` (its ``retry_after`` from the header) and the library
  backs the key off fleet-wide. It runs once ``from celery_semaphore import Adaptive,
  BackOff`` works; until then it is skipped, and says so.

**Scenario 1**: N = ``--tasks`` (600) calls of d = 0.2 s at C = 6 (ideal makespan N * d / C
= 20 s). Each round runs every chosen setup once, in an order rotated each round; reported
are the median (min-max) over the rounds of the makespan, its ratio to the oracle's in the
same round, the 429s, the requests admitted (must be N), the peak in flight (never above
C) and how busy the provider was (admitted request-seconds over C * makespan).

**Scenario 2**: N = ``--changing-tasks`` (1,400), adaptive only, C = 6, then 3 from 10 s,
then 9 from 25 s. No fixed limit follows C, so the figures are absolute, beside the ideal
makespan of a fleet that followed C exactly: the 429s; the 429s from 3 s after the drop
until the rise; the time from the rise until 8 requests are in flight; the makespan. It
runs once a round, among scenario 1's setups. ``--changing-with oracle`` (say) runs it with
a fixed setup instead, to try the harness before the adaptive limit exists.

Targets (issue 35), printed beside the figures: the adaptive makespan at most 1.25 times the
oracle's with 429s at most 5 % of the tasks; after the drop, at most 3 429s from 3 s after
it until the rise; after the rise, 8 in flight within 20 s.

``--quick`` is a smoke test: 120 tasks, 600 in scenario 2 with the drop at 5 s and the rise
at 12 s, one round. ``--timeline`` also prints each run's second-by-second C, mean and peak
in flight and 429s (always printed for scenario 2). Progress goes to stderr, the Markdown
tables to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from bench_worker import prefork_worker
from celery.exceptions import TimeoutError as ResultTimeout

from celery_semaphore.testing import RedisServer

try:
    from celery_semaphore import Adaptive, BackOff  # noqa: F401

    ADAPTIVE_MISSING = WHY_MISSING = ""
except ImportError as exc:
    ADAPTIVE_MISSING = "skipped: no Adaptive, BackOff in celery_semaphore yet (issue 35)"
    WHY_MISSING = f"`from celery_semaphore import Adaptive, BackOff` fails: {exc}"

RETRY_AFTER = "1"


# --- the provider -----------------------------------------------------------------------------


class Call(NamedTuple):
    """One request as the provider saw it: seconds from the first request's arrival."""

    arrival: float
    admitted: bool
    end: float  # a 429's is its arrival


def capacity_at(schedule: Sequence[tuple[float, int]], t: float) -> int:
    """C at ``t`` seconds from the first request."""
    return [c for at, c in schedule if at <= t][-1]


class Provider(ThreadingHTTPServer):
    """Admits at most C requests at once for ``duration`` seconds each, and
    answers 429 at once above that; ``schedule`` is ``[(seconds from the first request,
    C), ...]`` from 0."""

    daemon_threads = True
    request_queue_size = 128  # 16 processes connect at once: the default 5 would drop SYNs

    def __init__(self, duration: float, schedule: Sequence[tuple[float, int]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.duration = duration
        self.schedule = sorted(schedule)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.first: float | None = None
        self.records: list[list[Any]] = []  # [arrival, admitted, end], time.monotonic()

    def call(self) -> bool:
        """Serve one request: True if admitted (after its ``duration``), False for a 429."""
        with self.lock:
            now = time.monotonic()
            if self.first is None:
                self.first = now
            record = [now, False, now]
            self.records.append(record)
            if self.in_flight >= capacity_at(self.schedule, now - self.first):
                return False
            self.in_flight += 1
            record[1] = True
        time.sleep(self.duration)
        with self.lock:
            self.in_flight -= 1
            record[2] = time.monotonic()
        return True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: each pool process keeps its connection
    server: Provider

    def do_GET(self) -> None:
        admitted = self.server.call()
        body = b"ok" if admitted else b"busy"
        self.send_response(200 if admitted else 429)
        if not admitted:
            self.send_header("Retry-After", RETRY_AFTER)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


def _serve(duration: float, schedule: list[tuple[float, int]], line: Connection) -> None:
    """The provider's process: say the port on ``line``, serve until told to stop there,
    then send back the record (seconds from the first arrival)."""
    server = Provider(duration, schedule)
    line.send(server.server_address[1])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    line.recv()
    server.shutdown()
    with server.lock:
        first = server.first or 0.0
        line.send([(a - first, ok, e - first) for a, ok, e in server.records])


class ProviderProcess:
    """A :class:`Provider` in a process of its own (so this benchmark's own work never holds
    it up); ``url`` once entered, :meth:`record` stops it and answers its record."""

    def __init__(self, duration: float, schedule: list[tuple[float, int]]) -> None:
        context = multiprocessing.get_context("spawn")
        self._line, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(duration, schedule, child),
                                        daemon=True)  # fmt: skip
        self.url = ""

    def __enter__(self) -> ProviderProcess:
        self._process.start()
        if not self._line.poll(60):
            raise RuntimeError("the provider simulator did not start")
        self.url = f"http://127.0.0.1:{self._line.recv()}/"
        return self

    def record(self) -> list[Call]:
        self._line.send("stop")
        return [Call(*raw) for raw in self._line.recv()]

    def __exit__(self, *exc: object) -> None:
        self._process.terminate()
        self._process.join(timeout=10)


# --- the setups -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    task: str
    limit: Callable[[int], int] | None  # of C; None: adaptive


SETUPS = {
    "fixed20": Setup("provider_fixed", lambda c: 20),
    "oracle": Setup("provider_fixed", lambda c: c),
    "half": Setup("provider_fixed", lambda c: max(1, c // 2)),
    "adaptive": Setup("provider_adaptive", None),
}
CHANGING = "changing C"  # scenario 2's entry in a round


@dataclass
class Scenario:
    tasks: int
    schedule: list[tuple[float, int]]  # (seconds from the first request, C)


def run(setup: Setup, scenario: Scenario, args: argparse.Namespace) -> tuple[list[Call], int]:
    """Run ``scenario``'s tasks through a fresh fleet; the provider's record, and how many
    tasks did not succeed (failed, or not done within the run's time)."""
    capacity = scenario.schedule[0][1]
    env = {"BENCH_ADAPTIVE_INITIAL": "10", "BENCH_ADAPTIVE_MAX": "64"}
    if setup.limit:  # the fixed task's (the app's default when adaptive: any valid limit)
        env["BENCH_LIMIT"] = str(setup.limit(capacity))
    # Generous: ten times a fleet that kept C busy, plus two minutes.
    budget = 10 * ideal_makespan(scenario, args.duration) + 120
    with contextlib.ExitStack() as stack:
        provider = stack.enter_context(ProviderProcess(args.duration, scenario.schedule))
        broker = stack.enter_context(RedisServer())
        store = stack.enter_context(RedisServer())
        apps = [stack.enter_context(prefork_worker(
            broker.url, store.url, args.concurrency, name=f"provider{i}",
            app_module="provider_app", BENCH_PROVIDER_URL=provider.url, **env,
        )) for i in range(args.workers)]  # fmt: skip
        results = [apps[0].send_task(setup.task, (n,)) for n in range(scenario.tasks)]
        deadline = time.monotonic() + budget
        unsuccessful = 0
        for result in results:
            with contextlib.suppress(ResultTimeout):  # counted as not successful
                result.get(timeout=max(0.1, deadline - time.monotonic()), propagate=False)
            unsuccessful += result.state != "SUCCESS"
        return provider.record(), unsuccessful


# --- the figures ------------------------------------------------------------------------------


def ideal_makespan(scenario: Scenario, duration: float) -> float:
    """When a fleet that kept the provider's C busy from the first request would be done:
    where the capacity-seconds under the schedule reach N * d."""
    work = scenario.tasks * duration
    marks = [at for at, _ in scenario.schedule] + [float("inf")]
    for (at, c), end in zip(scenario.schedule, marks[1:], strict=True):
        if c * (end - at) >= work:
            return at + work / c
        work -= c * (end - at)
    raise AssertionError("unreachable: the last segment is unbounded")


def steps(calls: list[Call]) -> list[tuple[float, int]]:
    """(instant, requests in flight from it) at every admitted start and end; an end at the
    same instant as a start counts first."""
    events = sorted([(c.arrival, 1) for c in calls if c.admitted]
                    + [(c.end, -1) for c in calls if c.admitted])  # fmt: skip
    now, out = 0, []
    for at, step in events:
        now += step
        out.append((at, now))
    return out


def figures(calls: list[Call], scenario: Scenario, duration: float) -> dict[str, Any]:
    admitted = [c for c in calls if c.admitted]
    makespan = max((c.end for c in admitted), default=0.0)
    schedule = scenario.schedule
    # The capacity-seconds under the schedule over the makespan: how busy C could have been.
    marks = [at for at, _ in schedule[1:]] + [makespan]
    offered = sum(c * max(0.0, min(end, makespan) - at)
                  for (at, c), end in zip(schedule, marks, strict=True))  # fmt: skip
    found = steps(calls)
    return {
        "makespan": makespan,
        "ideal": ideal_makespan(scenario, duration),
        "refused": len(calls) - len(admitted),
        "admitted": len(admitted),
        "peak": max((n for _, n in found), default=0),
        "busy": sum(c.end - c.arrival for c in admitted) / offered * 100 if offered else 0.0,
    }


def changing_figures(calls: list[Call], scenario: Scenario) -> dict[str, Any]:
    """Scenario 2's own: 429s from 3 s after the drop until the rise, and seconds from the
    rise until one fewer than the new C are in flight (None: never)."""
    (drop, _), (rise, after) = scenario.schedule[1], scenario.schedule[2]
    settled = sum(not c.admitted and drop + 3 <= c.arrival < rise for c in calls)
    reached = next((at - rise for at, n in steps(calls) if at >= rise and n >= after - 1), None)
    return {"settled_429s": settled, "to_full": reached, "window": (drop + 3, rise),
            "full": after - 1}  # fmt: skip


def timeline(calls: list[Call], scenario: Scenario) -> list[list[str]]:
    """Per second from the first request: C, mean and peak in flight, 429s."""
    admitted = [c for c in calls if c.admitted]
    end = max((c.end for c in admitted), default=0.0)
    found = steps(calls)
    rows = []
    for second in range(int(end) + 1):
        lo, hi = float(second), second + 1.0
        mean = sum(max(0.0, min(c.end, hi) - max(c.arrival, lo)) for c in admitted)
        before = [n for at, n in found if at <= lo]
        peak = max([before[-1] if before else 0] + [n for at, n in found if lo < at < hi])
        refused = sum(not c.admitted and lo <= c.arrival < hi for c in calls)
        rows.append([f"{second}", str(capacity_at(scenario.schedule, lo)), f"{mean:.1f}",
                     str(peak), str(refused)])  # fmt: skip
    return rows


# --- the tables -------------------------------------------------------------------------------


def markdown(title: str, columns: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(flush=True)


def spread(values: list[float], form: str = "{:.1f}") -> str:
    """Median (min-max), or the one value."""
    if not values:
        return "n/a"
    middle = form.format(statistics.median(values))
    if len(values) == 1:
        return middle
    return f"{middle} ({form.format(min(values))}-{form.format(max(values))})"


def verdict(ok: bool | None, runs: list[dict[str, Any]], tasks: int) -> str:
    """PASS or FAIL; FAIL too when a run's provider did not admit every task exactly once (a
    makespan of the tasks that got through says nothing)."""
    if ok is None:
        return "n/a"
    short = [r["admitted"] for r in runs if r["admitted"] != tasks]
    if short:
        return f"FAIL (admitted {'/'.join(map(str, short))} of {tasks})"
    return "PASS" if ok else "FAIL"


def report_steady(rows: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
                  scenario: Scenario) -> None:  # fmt: skip
    capacity = scenario.schedule[0][1]
    oracle = rows.get("oracle", [])
    table = []
    for name, runs in rows.items():
        setup = SETUPS[name]
        limit = str(setup.limit(capacity)) if setup.limit else "Adaptive(10, max=64)"
        if not runs:
            table.append([name, limit, ADAPTIVE_MISSING, "", "", "", "", "", ""])
            continue
        ratios = [r["makespan"] / o["makespan"] for r, o in zip(runs, oracle, strict=False)]
        table.append([
            name, limit,
            spread([r["makespan"] for r in runs]),
            spread(ratios, "{:.2f}"),
            spread([r["refused"] for r in runs], "{:.0f}"),
            spread([r["refused"] / scenario.tasks * 100 for r in runs]),
            "/".join(str(r["admitted"]) for r in runs),
            str(max(r["peak"] for r in runs)),
            spread([r["busy"] for r in runs], "{:.0f}"),
        ])  # fmt: skip
    markdown(
        f"Scenario 1: {scenario.tasks} calls of {args.duration:g} s, provider C = {capacity} "
        f"(ideal makespan N * d / C = {ideal_makespan(scenario, args.duration):.1f} s), "
        f"{args.workers} prefork workers -c {args.concurrency}; {args.rounds} round(s), "
        "interleaved; median (min-max); every figure from the provider's record",
        ["setup", "limit", "makespan, s", "makespan / oracle's (same round)", "429s",
         "429s, % of tasks", "admitted", "peak in flight", "provider busy, % of C"],
        table,
    )  # fmt: skip
    runs = rows.get("adaptive", [])
    ratios = [r["makespan"] / o["makespan"] for r, o in zip(runs, oracle, strict=False)]
    share = [r["refused"] / scenario.tasks * 100 for r in runs]
    markdown(
        "Scenario 1 against issue 35's targets (the median over the rounds, the worst in "
        "brackets)",
        ["target", "adaptive", "verdict"],
        [
            ["makespan <= 1.25 x the oracle's",
             f"{statistics.median(ratios):.2f} ({max(ratios):.2f})" if ratios else
             ADAPTIVE_MISSING or "oracle or adaptive not run",
             verdict(statistics.median(ratios) <= 1.25 if ratios else None, runs,
                     scenario.tasks)],
            ["429s <= 5 % of the tasks",
             f"{statistics.median(share):.1f} % ({max(share):.1f} %)" if share else
             ADAPTIVE_MISSING or "adaptive not run",
             verdict(statistics.median(share) <= 5 if share else None, runs, scenario.tasks)],
        ],
    )  # fmt: skip


def report_changing(runs: list[dict[str, Any]], args: argparse.Namespace,
                    scenario: Scenario) -> None:  # fmt: skip
    (_, c0), (drop, c1), (rise, c2) = scenario.schedule
    about = (f"Scenario 2 ({args.changing_with}): {scenario.tasks} calls of {args.duration:g} s, "
             f"C = {c0}, {c1} from {drop:g} s, {c2} from {rise:g} s (from the first request); "
             f"{len(runs)} round(s); median (min-max)")  # fmt: skip
    if not runs:
        markdown(about, ["figure", "value"], [["all", ADAPTIVE_MISSING or "not run"]])
        return
    start, stop = runs[0]["window"]
    full = runs[0]["full"]
    reached = [r["to_full"] for r in runs if r["to_full"] is not None]
    never = len(runs) - len(reached)
    settled = [r["settled_429s"] for r in runs]
    markdown(about, ["figure", "value", "target", "verdict"], [
        ["makespan, s", spread([r["makespan"] for r in runs]),
         f"(ideal, C followed exactly: {runs[0]['ideal']:.1f})", ""],
        ["429s", spread([r["refused"] for r in runs], "{:.0f}"), "", ""],
        [f"429s from {start:g} s until {stop:g} s (drop + 3 s until the rise)",
         spread(settled, "{:.0f}"), "<= 3",
         verdict(statistics.median(settled) <= 3, runs, scenario.tasks)],
        [f"seconds from the rise until {full} in flight",
         spread(reached) + (f", never in {never} of {len(runs)}" if never else ""), "<= 20",
         verdict(never == 0 and statistics.median(reached) <= 20, runs, scenario.tasks)],
        ["admitted", "/".join(str(r["admitted"]) for r in runs), f"{scenario.tasks}", ""],
        ["provider busy, % of C", spread([r["busy"] for r in runs], "{:.0f}"), "", ""],
    ])  # fmt: skip


# --- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 120 tasks, 600 in scenario 2 with C changing at "
                             "5 s and 12 s, one round")  # fmt: skip
    parser.add_argument("--setups", nargs="*", choices=[*SETUPS, CHANGING],
                        default=[*SETUPS, CHANGING],
                        help=f"what each round runs (default all; {CHANGING!r} is scenario "
                             "2)")  # fmt: skip
    parser.add_argument("--changing-with", choices=list(SETUPS), default="adaptive",
                        help="the setup scenario 2 runs (default adaptive)")  # fmt: skip
    parser.add_argument("--tasks", type=int, help="scenario 1's N (default 600)")
    parser.add_argument("--changing-tasks", type=int, help="scenario 2's N (default 1400)")
    parser.add_argument("--duration", type=float, default=0.2, help="d, seconds")
    parser.add_argument("--capacity", type=int, default=6,
                        help="the provider's C (scenario 2: C, C/2, 3C/2)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8, help="-c of each worker")
    parser.add_argument("--timeline", action="store_true",
                        help="print every run's per-second timeline")  # fmt: skip
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    c = args.capacity
    drop, rise = (5.0, 12.0) if args.quick else (10.0, 25.0)
    steady = Scenario(args.tasks or (120 if args.quick else 600), [(0.0, c)])
    changing = Scenario(args.changing_tasks or (600 if args.quick else 1400),
                        [(0.0, c), (drop, max(1, c // 2)), (rise, c + c // 2)])  # fmt: skip
    names = list(args.setups)
    if ADAPTIVE_MISSING:
        skipped = [n for n in names if n == "adaptive"
                   or (n == CHANGING and args.changing_with == "adaptive")]  # fmt: skip
        if skipped:
            print(f"{', '.join(skipped)}: {ADAPTIVE_MISSING}; {WHY_MISSING}", file=sys.stderr,
                  flush=True)  # fmt: skip
        names = [n for n in names if n not in skipped]
    rows: dict[str, list[dict[str, Any]]] = {n: [] for n in args.setups if n != CHANGING}
    changing_rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        shift = round_ % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            scenario = changing if name == CHANGING else steady
            setup = SETUPS[args.changing_with if name == CHANGING else name]
            started = time.monotonic()
            calls, unsuccessful = run(setup, scenario, args)
            found = figures(calls, scenario, args.duration)
            if name == CHANGING:
                found.update(changing_figures(calls, scenario))
                changing_rows.append(found)
            else:
                rows[name].append(found)
            summary = {k: round(v, 2) if isinstance(v, float) else v for k, v in found.items()}
            print(f"round {round_ + 1}, {name}: {summary}, {unsuccessful} tasks not "
                  f"successful, {time.monotonic() - started:.0f} s in all", file=sys.stderr,
                  flush=True)  # fmt: skip
            if args.timeline or name == CHANGING:
                markdown(f"Timeline, round {round_ + 1}, {name} (seconds from the first "
                         "request)", ["second", "C", "mean in flight", "peak", "429s"],
                         timeline(calls, scenario))  # fmt: skip
    if rows:
        report_steady(rows, args, steady)
    if CHANGING in args.setups:
        report_changing(changing_rows, args, changing)


if __name__ == "__main__":
    main()
