"""What the bodies ran, recorded outside the library, and the one checker of it.

Every concurrency, fault and soak test judges a run by this record, never by the library's own
claims. A body records itself with :func:`run` into a Redis list through a plain client of its
own (a Celery task body, a thread, a subprocess): its semaphore key, weight, start and end
(``time.monotonic()``, system-wide on Linux, so comparable across processes on one machine),
worker node name, pid, task id, and whether its slot was reported lost. A body that holds
several keys at once records one run under all of them. A body that may be killed midway
records its start first (``mark_start=True``), so a kill leaves a run that started and never
ended.

:meth:`History.check` (and :meth:`History.assert_ok`) then reports, for each key, the most
weight in flight at any moment against the key's limit at that moment (a schedule of limit
changes is accepted, see :func:`limit_schedule`; a moment the store lost every slot ends the
slots granted before it); the completed runs of each task id (exactly one unless the test names
why more are allowed); that every expected task is accounted for; that every run that started
ended, unless the test killed it; and that no slot was lost unless the test expects it.

A test whose processes are killed may also call :func:`record_deliveries` in them, so that the
checker knows which task each killed process was running (its body, or a shed or park that
never reached a body) when it died.
"""

from __future__ import annotations

import heapq
import json
import os
import socket
import time
import uuid
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

Limit = int | Sequence[tuple[float, int]]
"""A key's limit: a number, or a schedule of ``(since, limit)`` pairs, ``since`` a
``time.monotonic()`` reading; before the first pair the first limit holds."""

Wipe = tuple[float, float]
"""A moment the semaphore's store lost every slot (a restart without persistence): its
``time.monotonic()`` reading and its epoch time, the clock the store stamps slots with."""

BODIES = "bodies"
"""The history that the tests' bodies record in (each run under its semaphore key)."""

MOST_LISTED = 5
"""Moments over the limit listed per key in a failure message (the rest are counted)."""


def history_key(name: str) -> str:
    """The Redis list that history ``name`` is recorded in."""
    return f"test:history:{name}"


def deliveries_key(name: str) -> str:
    """The Redis list that :func:`record_deliveries` writes history ``name``'s deliveries in."""
    return history_key(f"{name}:deliveries")


def record_deliveries(client: Any, name: str, prefix: str) -> None:
    """Record, in this process, the start of every delivery of a Celery task whose name starts
    with ``prefix`` (Celery's ``task_prerun``, before the semaphore is asked): its task id and
    pid, through ``client``. A process killed in the middle of a task is then known to have
    been running it even if no body started, say while it shed the run: the run's message was
    published again and its own delivery, not yet acknowledged, is redelivered too, so at-least-
    once delivery may run that task twice."""
    from celery.signals import task_prerun

    def started(task_id: str = "", task: Any = None, **_: Any) -> None:
        if task is not None and task.name.startswith(prefix):
            event = {"task": task_id, "pid": os.getpid(), "start": time.monotonic()}
            client.rpush(deliveries_key(name), json.dumps(event))

    task_prerun.connect(started, weak=False)


@dataclass
class Recording:
    """What :func:`run` yields: the body may mark its slot lost or add data before it ends."""

    run_id: str
    start: float
    data: dict[str, Any]
    lost: bool = False


def _current_request() -> Any:
    """The request of the Celery task whose body runs in this thread, if any."""
    from celery import current_task

    return current_task.request if current_task else None


@contextmanager
def run(
    client: Any,
    name: str,
    key: str | Sequence[str],
    *,
    task_id: str | None = None,
    weight: int = 1,
    worker: str | None = None,
    slot: Any = None,
    mark_start: bool = False,
    data: Mapping[str, Any] | None = None,
) -> Iterator[Recording]:
    """Record the block as one run of ``key`` in history ``name``, through ``client`` (a plain
    ``redis.Redis`` of the body's own, not the library's). ``key`` may list several keys, for
    a body that holds a slot of each (``weight`` units of each) at once.

    ``task_id`` and ``worker`` default to the running Celery task's id and worker node name
    (outside a task: a fresh id, and this host). The run counts as lost if ``slot`` (the
    body's Slot) reports its lease lost when the block ends, or the body sets
    ``recording.lost``. With ``mark_start`` the start is recorded as the block begins, so a
    body killed inside it shows as a run that started and never ended. ``data`` (JSON) is
    kept with the run; the body may add to ``recording.data`` too."""
    request = _current_request()
    keys = [key] if isinstance(key, str) else list(key)
    event: dict[str, Any] = {
        "run": uuid.uuid4().hex,
        "key": keys[0],
        "keys": keys,
        "task": task_id or (request and request.id) or f"call-{uuid.uuid4().hex[:12]}",
        "weight": weight,
        "worker": worker or (request and request.hostname) or socket.gethostname(),
        "pid": os.getpid(),
        "start": time.monotonic(),
        "data": dict(data or {}),
    }
    if mark_start:
        client.rpush(history_key(name), json.dumps(event))
    recording = Recording(event["run"], event["start"], event["data"])
    try:
        yield recording
    finally:
        event["end"] = time.monotonic()
        event["lost"] = recording.lost or bool(slot is not None and slot.lost.is_set())
        client.rpush(history_key(name), json.dumps(event))


@dataclass(frozen=True)
class Run:
    """One body's run as it recorded itself; ``end`` is None for a run that never ended.
    ``keys``: every key it held (``key`` is the first)."""

    key: str
    task_id: str
    start: float
    end: float | None
    weight: int = 1
    worker: str = ""
    pid: int = 0
    lost: bool = False
    data: dict[str, Any] = field(default_factory=dict, compare=False)
    run_id: str = ""
    keys: tuple[str, ...] = ()

    def holds(self, key: str) -> bool:
        return key == self.key or key in self.keys

    def describe(self, origin: float) -> str:
        ended = "never ended" if self.end is None else f"ended +{self.end - origin:.3f}s"
        return (f"task {self.task_id} (started +{self.start - origin:.3f}s, {ended}, "
                f"pid {self.pid} on {self.worker})")  # fmt: skip


@dataclass
class Report:
    """What :meth:`History.check` found. ``peaks``: the most weight in flight per key (runs
    that kept their slot); ``limits`` and ``lowest``: the highest and lowest limit of each
    key's schedule; ``missing``: expected tasks with no completed run; ``excused``: how many
    of them each ``may_miss`` reason covers; ``repeated``: runs beyond a task's first, per
    allowance; ``problems``: one line per thing that broke, empty when all held."""

    peaks: dict[str, int]
    limits: dict[str, int]
    runs: int
    unfinished: int
    lost: int
    tasks: int
    missing: list[str]
    repeated: dict[str, int]
    problems: list[str]
    lowest: dict[str, int] = field(default_factory=dict)
    excused: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def limit_of(self, key: str) -> str:
        """The limit of ``key``, with the range it spanned when it changed."""
        top = self.limits[key]
        low = self.lowest.get(key, top)
        return str(top) if low == top else f"{top} (limit {low}-{top} over the run)"

    def summary(self) -> str:
        peaks = ", ".join(f"{k} {p} of {self.limit_of(k)}" for k, p in sorted(self.peaks.items()))
        repeated = "".join(f", {n} run {why}" for why, n in sorted(self.repeated.items()))
        excused = "".join(f", {n} {why}" for why, n in sorted(self.excused.items()))
        return (f"peak in flight (slot kept): {peaks or 'none'}; {self.runs} runs of "
                f"{self.tasks} tasks ({self.unfinished} never ended, {self.lost} lost their "
                f"slot{repeated}); tasks missing: {len(self.missing)}{excused}")  # fmt: skip

    def __str__(self) -> str:
        if self.ok:
            return self.summary()
        return "\n".join([f"the history broke {len(self.problems)} rule(s):",
                          *(f"  - {p}" for p in self.problems), self.summary()])  # fmt: skip


def _limit_at(schedule: Sequence[tuple[float, int]], moment: float) -> int:
    """The limit of a sorted, non-empty ``schedule`` at ``moment``."""
    index = bisect_right([since for since, _ in schedule], moment) - 1
    return schedule[max(index, 0)][1]


def _top(limit: Limit) -> int:
    return limit if isinstance(limit, int) else max(n for _, n in limit)


def _bottom(limit: Limit) -> int:
    return limit if isinstance(limit, int) else min(n for _, n in limit)


def _slot_end(r: Run, wiped: Sequence[Wipe]) -> float:
    """When ``r``'s slot stopped counting: its end, or the first wipe after the store granted
    it (``data["admitted"]``, epoch seconds by the store's clock; else its start)."""
    end = r.end if r.end is not None else r.start
    for monotonic, epoch in wiped:
        admitted = r.data.get("admitted")
        before = admitted < epoch if admitted is not None else r.start < monotonic
        if before and end > monotonic:
            end = monotonic
    return end


def limit_schedule(
    first: int, changes: Sequence[tuple[float, float, int]], grace: float
) -> list[tuple[float, int]]:
    """The schedule (see :data:`Limit`) a key's runs are judged by when its limit changed
    while they ran: ``first`` until the first change, then each of ``changes``, ``(sent,
    answered, limit)`` in the order they were made, ``time.monotonic()`` readings taken just
    before the change was sent and just after it was answered.

    A limit applies from the moment its change was sent (the store may grant slots by it at
    once), and the limit it replaced still applies for ``grace`` seconds after the change was
    answered: a slot granted just before can begin its body that much later. Lowering a limit
    evicts nobody, and a slot handed to a parked run before the change is claimed up to the
    hand-off's claim timeout later, so ``grace`` is at least that. Where limits overlap, the
    highest applies. A run must not *start* above the limit that applies at its start, with
    every slot still held counted, those granted before the change too.
    """
    regimes = [(float("-inf"), first)] + [(sent, limit) for sent, _, limit in changes]
    ends = [answered + grace for _, answered, _ in changes] + [float("inf")]
    moments = sorted({since for since, _ in regimes} | set(ends[:-1]))
    schedule: list[tuple[float, int]] = []
    for moment in moments:
        limit = max(
            n for (since, n), until in zip(regimes, ends, strict=True) if since <= moment < until
        )
        if not schedule or schedule[-1][1] != limit:
            schedule.append((moment, limit))
    return schedule


@dataclass
class History:
    """The runs of one history, in the order they started, and the deliveries that
    :func:`record_deliveries` saw (``(task id, pid)``, in the order they started)."""

    runs: list[Run]
    deliveries: list[tuple[str, int]] = field(default_factory=list)

    @classmethod
    def load(cls, client: Any, name: str) -> History:
        """Read history ``name``: a run recorded with ``mark_start`` and no end never ended."""
        merged: dict[str, dict[str, Any]] = {}
        for raw in client.lrange(history_key(name), 0, -1):
            event = json.loads(raw)
            merged.setdefault(event["run"], {}).update(event)
        runs = [Run(key=e["key"], task_id=e["task"], start=e["start"], end=e.get("end"),
                    weight=e["weight"], worker=e["worker"], pid=e["pid"],
                    lost=e.get("lost", False), data=e["data"], run_id=e["run"],
                    keys=tuple(e.get("keys") or [e["key"]]))
                for e in merged.values()]  # fmt: skip
        events = [json.loads(raw) for raw in client.lrange(deliveries_key(name), 0, -1)]
        deliveries = [(e["task"], e["pid"]) for e in sorted(events, key=lambda e: e["start"])]
        return cls(sorted(runs, key=lambda r: r.start), deliveries)

    @property
    def completed(self) -> list[Run]:
        return [r for r in self.runs if r.end is not None]

    @property
    def unfinished(self) -> list[Run]:
        return [r for r in self.runs if r.end is None]

    def of(self, key: str) -> History:
        """The runs of ``key`` only."""
        return History([r for r in self.runs if r.holds(key)], self.deliveries)

    def values(self, name: str, completed: bool = False) -> list[Any]:
        """``data[name]`` of each run (or each completed run), in the order they started."""
        return [r.data[name] for r in (self.completed if completed else self.runs)]

    def _origin(self) -> float:
        return self.runs[0].start if self.runs else 0.0

    def _sweep(
        self, runs: Iterable[Run], limit: Limit | None = None, wiped: Sequence[Wipe] = ()
    ) -> tuple[int, list[str]]:
        """The most weight in flight among ``runs`` (completed, slot kept), and a line for each
        start that put the weight in flight over ``limit`` as of that moment. A slot granted
        before a moment in ``wiped`` counts only until then (see :meth:`check`)."""
        origin = self._origin()
        schedule = [(float("-inf"), limit)] if isinstance(limit, int) else sorted(limit or [])
        held = [(r.start, _slot_end(r, wiped), r) for r in runs if r.end is not None and not r.lost]
        in_flight: list[tuple[float, int, Run]] = []
        weight = peak = 0
        over: list[str] = []
        for n, (start, end, r) in enumerate(sorted(held, key=lambda h: h[0])):
            while in_flight and in_flight[0][0] <= start:  # ending as another starts: not both
                weight -= heapq.heappop(in_flight)[2].weight
            if end < start:  # its slot was gone before its body began
                continue
            heapq.heappush(in_flight, (end, n, r))
            weight += r.weight
            peak = max(peak, weight)
            allowed = _limit_at(schedule, start) if schedule else weight
            if weight > allowed:
                ids = ", ".join(sorted(f.task_id for _, _, f in in_flight))
                over.append(f"{weight} in flight (limit {allowed}) at +{start - origin:.3f}s "
                            f"when {r.task_id} started: {ids}")  # fmt: skip
        return peak, over

    def peak(self, *keys: str) -> int:
        """The most weight in flight at one moment among the runs of ``keys`` (of every key
        if none is named) that kept their slot."""
        return self._sweep(r for r in self.runs if not keys or any(map(r.holds, keys)))[0]

    def check(
        self,
        limits: Mapping[str, Limit],
        *,
        tasks: Collection[str] | None = None,
        repeats: Mapping[str, Collection[str]] | None = None,
        killed: Collection[str] = (),
        killed_pids: Collection[int] = (),
        lost: Collection[str] = (),
        may_lose: str = "",
        may_miss: Mapping[str, Collection[str]] | None = None,
        wiped: Sequence[Wipe] = (),
    ) -> Report:
        """Check the history against its rules, and report.

        * ``limits``: every key that ran must be named; at no run's start may the weight in
          flight (runs that ended and kept their slot) exceed the key's limit at that moment.
          ``wiped``: moments the store lost every slot; a slot it granted before one counts
          only until then, since it is gone from the store (its holder learns at its next
          renewal, or its body ends first).
        * ``tasks``: the task ids expected to run; each must have exactly one completed run,
          and no other task may have one. Without it, each task that ran has one.
          ``may_miss``: why some expected tasks may have none, ``{reason: task ids}``; the
          report counts each of them once, under the first reason that names it.
        * ``repeats``: why some tasks may complete more often, ``{reason: task ids}``; each
          reason that names a task allows it one more completed run.
        * ``killed``: tasks the test killed once mid-body; each must have one run that never
          ended.
          ``killed_pids``: processes the test killed; their runs may never end, and the last
          run to end in each may run again (its process died after the body, before its task
          returned: at-least-once delivery runs it again). So may the task whose delivery
          each was running when it died, if :func:`record_deliveries` saw it. Any other run
          must end.
        * ``lost``: tasks that must report their slot lost (in at least one run);
          ``may_lose``: why any run may. No other run may report its slot lost.
        """
        origin = self._origin()
        expected = None if tasks is None else set(tasks)
        problems: list[str] = []
        peaks: dict[str, int] = {}
        for key in sorted({k for r in self.runs for k in r.keys} | set(limits)):
            runs = [r for r in self.runs if r.holds(key)]
            if key not in limits:
                problems.append(f"key {key!r}: {len(runs)} run(s) but no limit given")
                continue
            peaks[key], over = self._sweep(runs, limits[key], wiped)
            problems += [f"key {key!r}: {line}" for line in over[:MOST_LISTED]]
            if len(over) > MOST_LISTED:
                problems.append(f"key {key!r}: over its limit at {len(over) - MOST_LISTED} "
                                "more start(s)")  # fmt: skip

        allowed: Counter[str] = Counter()
        why: dict[str, list[str]] = defaultdict(list)
        for reason, ids in (repeats or {}).items():
            for task_id in ids:
                allowed[task_id] += 1
                why[task_id].append(reason)
        last_ended: dict[int, Run] = {}
        for r in sorted(self.completed, key=lambda r: r.end or 0.0):
            if r.pid in killed_pids:
                last_ended[r.pid] = r
        for r in last_ended.values():
            allowed[r.task_id] += 1
            why[r.task_id].append("its process was killed after the body ended")
        in_flight = {pid: task_id for task_id, pid in self.deliveries if pid in killed_pids}
        for pid, task_id in in_flight.items():
            if last_ended.get(pid) is None or last_ended[pid].task_id != task_id:
                allowed[task_id] += 1
                why[task_id].append("its process was killed while it ran the task")

        completed: dict[str, list[Run]] = defaultdict(list)
        for r in self.completed:
            completed[r.task_id].append(r)
        repeated: Counter[str] = Counter()
        for task_id, runs in sorted(completed.items()):
            if expected is not None and task_id not in expected:
                problems.append(f"task {task_id}: not expected to run, but completed "
                                f"{len(runs)} run(s): "
                                f"{'; '.join(r.describe(origin) for r in runs)}")  # fmt: skip
            elif len(runs) > 1 + allowed[task_id]:
                because = "".join(f", {reason}" for reason in why[task_id])
                problems.append(f"task {task_id}: {len(runs)} completed runs (allowed "
                                f"{1 + allowed[task_id]}{because}): "
                                f"{'; '.join(r.describe(origin) for r in runs)}")  # fmt: skip
            elif len(runs) > 1:
                for reason in why[task_id][: len(runs) - 1]:
                    repeated[reason] += 1
        missing = sorted((expected or set()) - set(completed))
        reasons = {reason: set(ids) for reason, ids in (may_miss or {}).items()}
        excused: Counter[str] = Counter()
        for task_id in missing:
            why_missing = next((r for r, ids in reasons.items() if task_id in ids), None)
            if why_missing is not None:  # counted once, under the first reason that names it
                excused[why_missing] += 1
                continue
            started = [r for r in self.runs if r.task_id == task_id]
            detail = "; ".join(r.describe(origin) for r in started) or "never started"
            problems.append(f"task {task_id}: expected, but no run of it completed ({detail})")

        for r in self.unfinished:
            if r.task_id not in killed and r.pid not in killed_pids:
                problems.append(f"run of {r.describe(origin)}: not killed by the test")
        unfinished = Counter(r.task_id for r in self.unfinished)
        problems += [f"task {task_id}: killed once by the test, but {unfinished[task_id]} of its "
                     "runs never ended" for task_id in sorted(set(killed))
                     if unfinished[task_id] != 1]  # fmt: skip

        lost_runs = [r for r in self.runs if r.lost]
        if not may_lose:
            problems += [f"run of {r.describe(origin)}: reported its slot lost"
                         for r in lost_runs if r.task_id not in lost]  # fmt: skip
        lost_ids = {r.task_id for r in lost_runs}
        problems += [f"task {task_id}: expected to report its slot lost, but no run of it did"
                     for task_id in sorted(set(lost) - lost_ids)]  # fmt: skip

        return Report(
            peaks=peaks,
            limits={k: _top(v) for k, v in limits.items()},
            lowest={k: _bottom(v) for k, v in limits.items()},
            runs=len(self.runs),
            unfinished=len(self.unfinished),
            lost=len(lost_runs),
            tasks=len({r.task_id for r in self.runs}),
            missing=missing,
            excused={reason: n for reason, n in excused.items() if n},
            repeated={f"again ({reason})": n for reason, n in repeated.items()},
            problems=problems,
        )

    def assert_ok(self, limits: Mapping[str, Limit], **rules: Any) -> Report:
        """:meth:`check`, failing the test with every problem listed; the report otherwise."""
        report = self.check(limits, **rules)
        if not report.ok:
            raise AssertionError(str(report))
        return report
