"""Soak: a stream of mixed bounded tasks over prefork, solo and threads workers while a chaos
loop breaks things; nothing over the limit in effect, nothing lost but what a restart of the
store is documented to lose, nothing run twice but what at-least-once delivery allows,
nothing left held.

The tasks (tests/celery_apps.py, ``add_soak_tasks``): one key, two keys at once, a weight of
2 or 3 units, all in the waiting room (``on_full="queue"``), and on a key of their own, runs
that shed with a countdown instead (``on_full="retry"``). They are sent in batches, so the
rooms always hold a backlog, over two prefork workers (3 processes each) and a solo worker,
all subprocesses, and a threads worker (4 threads) in this process. The app uses Celery's
at-least-once settings (acks_late, reject_on_worker_lost): a task whose process is killed
runs again instead of failing.

The chaos loop (seeded: ``--soak-seed``) deals the faults from a shuffled deck, one each
time 50 to 150 more tasks have finished (0.5 to 3 s apart), and deals again while tasks
remain: SIGKILL a pool process (one holding a slot when it can); SIGKILL a whole worker, or
stop it with SIGTERM (a warm shutdown, which goes on while the soak does), and start another
of its kind; freeze the semaphore's Redis (SIGSTOP) for longer than a lease; restart it
without persistence (everything in it lost); raise or lower a key's live limit.

What is checked, by the bodies' own records (tests/history.py):

* No run starts above the limit in effect at its start, counting every slot still held. A
  raise applies from when it is sent; a lowering from a grace after its answer (a slot handed
  off just before is claimed up to the claim timeout later); a restart forgets live limits
  until the workers put back the last they saw; a slot granted before a restart counts only
  until it (guarantees.md: "New runs are admitted at once"; its holder learns at its next
  renewal).
* Every task completes a run, but for those a restart took, as guarantees.md says it does
  (parked in a room, handed a slot, or redelivered after it with a hand-off claimed before
  it), and at most one per worker killed whole: the message it had just taken off the queue
  (kombu's Redis transport records it as unacknowledged only afterwards). A run that sheds is
  never lost to a restart: its message stays in the broker.
* A task runs once, or again when at-least-once delivery says so: its process was killed
  after its body ended or while it ran it, or it had begun in a worker killed or stopped
  before acknowledging its message.
* Every run that started ended, but in a killed process; a slot is reported lost only in a
  freeze or a restart; no slot is held and no run parked once the soak has drained.

The report gives the faults, the peak per key against its limit, the tasks lost and the runs
duplicated (each with why), the slots leaked, and the time from the first task sent to the
last body's end against an ideal: the work of the busiest key (the units times seconds of
the bodies that hold it) over its limit in the code.

In CI it runs 1,000 tasks (``pytest -m soak tests/test_soak.py -s`` prints the report);
``--soak-tasks N`` sends more, and ``--soak-minutes M`` keeps sending and breaking things for
M minutes, then drains and checks.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.states import READY_STATES

from celery_semaphore import Semaphore, SemaphoreBackendError
from celery_semaphore.core.names import redis_keys
from celery_semaphore.integration.settings import journal_for
from celery_semaphore.integration.waiting_room.handoffs import publisher_for
from celery_semaphore.testing import RedisServer

from .celery_apps import (
    AT_LEAST_ONCE,
    SOAK_CLAIM_TIMEOUT,
    SOAK_LEASE,
    SOAK_LIMITS,
    add_soak_tasks,
    make_app,
)
from .helpers import QUEUES, child_pids, queued, stop_process, unacked_task_ids, wait_for
from .history import BODIES, History, Report, Wipe, history_key, limit_schedule

ROOT = Path(__file__).resolve().parent.parent
PROVIDER, TENANT, SHED = SOAK_LIMITS
LIVE_KEYS = {PROVIDER: 3, TENANT: 1}
"""The keys whose live limit the chaos changes, and the lowest it sets: a provider run may
weigh 3 units, and a live limit below a run's weight stops its room until it is raised."""
MIX = {"csem.soak_one": 0.35, "csem.soak_both": 0.25, "csem.soak_heavy": 0.2,
       "csem.soak_shed": 0.2}  # fmt: skip
KEYS_OF = {"csem.soak_one": [PROVIDER], "csem.soak_both": [PROVIDER, TENANT],
           "csem.soak_heavy": [PROVIDER], "csem.soak_shed": [SHED]}  # fmt: skip
BODY = (0.0, 0.05)
"""Seconds a body sleeps, drawn uniformly."""
BATCH = 100
"""Tasks sent at once, whenever fewer than this many are still to finish: the rooms keep a
backlog, and the broker's queue stays short enough for hand-offs to arrive in time."""
PACE = (50, 150)
"""Tasks that finish (or are known lost) between two faults, drawn uniformly: a deal of
faults spreads over a CI-sized soak."""
GAP = (0.5, 3.0)
"""Seconds between two faults, at least and at most (the chaos goes on if progress stalls)."""
FREEZE = 1.5 * SOAK_LEASE
"""How long the store is frozen: every lease lapses."""
DOWN = 0.5
"""How long the store stays down in a restart (runs that ask meanwhile are shed)."""
SWEEP_INTERVAL = float(os.environ.get("CSEM_TEST_SWEEP_INTERVAL", 2.0))
"""The workers' ``semaphore_sweep_interval`` (tests/celery_apps.py), at which each puts back
the live limits a restart of the store lost."""
GRACE = SOAK_CLAIM_TIMEOUT + 1.0
"""How long the limit a change replaced may still apply (see :func:`limit_schedule`)."""
DECK = ["worker killed", "pool process killed", "pool process killed", "worker stopped",
        "store frozen", "store restarted", "limit raised", "limit lowered"]  # fmt: skip
"""One of each fault, two pool kills. The first deal starts with a whole worker SIGKILLed:
its unacknowledged messages come back only once the broker's visibility timeout (20 s) has
passed, which the rest of the run then covers."""
MAY_LOSE = "the store froze for 1.5 leases, or restarted empty"
"""Why a run may report its slot lost."""
PARKED = "parked when the store restarted"
HANDED = "handed a slot the store lost in a restart"
CLAIMED = "redelivered after a restart with a hand-off claimed before it"
POPPED = "taken off the queue by a worker killed whole before it recorded the message"
UNACKED = "its worker was killed or stopped before acknowledging it"


@dataclass
class Worker:
    kind: str
    name: str
    proc: subprocess.Popen[bytes]


class Fleet:
    """The soak's subprocess workers: prefork (3 processes) and solo, each in a process group
    of its own so that it can be killed whole."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self.workers: list[Worker] = []
        self.started: Counter[str] = Counter()
        self.stopping: dict[int, tuple[Worker, float]] = {}
        self.warm_stops: list[float] = []
        """How long each warm shutdown took, seconds."""

    def start(self, kind: str) -> Worker:
        self.started[kind] += 1
        name = f"soak-{kind}-{self.started[kind]}-{uuid.uuid4().hex[:6]}@%h"
        pool = ["-P", "prefork", "-c", "3"] if kind == "prefork" else ["-P", "solo"]
        log = (self.tmp_path / f"{kind}-{self.started[kind]}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.celery_apps", "worker", *pool,
             "-n", name, "--without-gossip", "--without-mingle", "--loglevel=WARNING"],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        worker = Worker(kind, name, proc)
        self.workers.append(worker)
        return worker

    def alive(self) -> list[Worker]:
        """The workers up and not shutting down."""
        return [w for w in self.workers
                if w.proc.poll() is None and w.proc.pid not in self.stopping]  # fmt: skip

    def stop_warm(self, worker: Worker) -> None:
        """SIGTERM ``worker`` and let it shut down warm while the soak goes on: billiard makes
        a pool process wait up to 30 s at exit for the main process to read its last results,
        which a main process already shutting down may never do."""
        worker.proc.send_signal(signal.SIGTERM)
        self.stopping[worker.proc.pid] = (worker, time.monotonic())

    def reap(self, longest: float = 60.0) -> list[Worker]:
        """Note the warm shutdowns that ended; the workers still shutting down after
        ``longest`` seconds (to be killed)."""
        stuck = []
        for pid, (worker, since) in list(self.stopping.items()):
            if worker.proc.poll() is not None:
                self.warm_stops.append(time.monotonic() - since)
                del self.stopping[pid]
            elif time.monotonic() - since > longest:
                stuck.append(worker)
        return stuck

    def pool(self) -> list[int]:
        """The pool processes of the prefork workers still up."""
        return [p for w in self.alive() if w.kind == "prefork" for p in child_pids(w.proc.pid)]

    def close(self) -> None:
        """Stop every worker; one still shutting down is past its last task: kill it."""
        for pid in self.stopping:
            with suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for w in self.workers:
            stop_process(w.proc, timeout=60)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _queued_task_ids(client: redis.Redis) -> set[str]:
    """The task ids of the messages waiting in the broker's default queue and its hand-off
    queue."""
    return {json.loads(raw)["headers"]["id"]
            for queue in QUEUES for raw in client.lrange(queue, 0, -1)}  # fmt: skip


@dataclass
class Chaos:
    """Deals the faults and keeps what the checker needs to know of them."""

    rng: random.Random
    store: RedisServer
    broker: redis.Redis
    fleet: Fleet
    sem: Semaphore
    pending: Callable[[], set[str]]
    """The tasks sent and not yet finished."""
    counts: Counter[str] = field(default_factory=Counter)
    killed_pids: set[int] = field(default_factory=set)
    held: list[tuple[set[int], set[str]]] = field(default_factory=list)
    """For each worker killed or stopped: its processes, and the tasks whose messages were
    unacknowledged then (by it or by any other worker)."""
    lost: dict[str, set[str]] = field(
        default_factory=lambda: {PARKED: set(), HANDED: set(), CLAIMED: set(), POPPED: set()}
    )
    """Tasks that may be lost, by why: what the store held when it restarted, and what the
    broker held nowhere when a worker was killed whole."""
    wipes: list[Wipe] = field(default_factory=list)
    changes: dict[str, list[tuple[float, float, int]]] = field(
        default_factory=lambda: {key: [] for key in SOAK_LIMITS}
    )
    live: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(SOAK_LIMITS))
    deck: list[str] = field(default_factory=list)
    dealt: int = 0
    timeline: list[tuple[float, str]] = field(default_factory=list)

    def next_fault(self) -> str:
        if not self.deck:
            self.deck = list(DECK)
            self.rng.shuffle(self.deck)
            if self.dealt == 0:
                self.deck.remove("worker killed")
                self.deck.insert(0, "worker killed")
        self.dealt += 1
        return self.deck.pop(0)

    @property
    def dealt_all(self) -> bool:
        """At least one deal is done: every kind of fault has happened."""
        return self.dealt >= len(DECK) and not self.deck

    def unacked(self, deliveries: list[tuple[str, int]]) -> set[str]:
        """The tasks that a worker killed or stopped had begun to run (``deliveries``: task
        id and pid, from :func:`record_deliveries`) while their messages were unacknowledged:
        each may run again, at least once."""
        return {task_id for pids, unacked in self.held for task_id, pid in deliveries
                if pid in pids and task_id in unacked}  # fmt: skip

    @property
    def may_miss(self) -> set[str]:
        return set().union(*self.lost.values())

    def inject(self, fault: str) -> None:
        """Inject ``fault``, and count it (under another name when it turned into another)."""
        at = time.monotonic()
        done = getattr(self, "_" + fault.replace(" ", "_"))() or fault
        self.counts[done] += 1
        self.timeline.append((at, done))

    # -- processes -------------------------------------------------------------------------

    def _pool_process_killed(self) -> None:
        """SIGKILL a pool process, one that holds a slot if one is found within 2 s."""
        found: list[int] = []

        def holding() -> bool:
            try:
                pids = {
                    h.metadata.get("pid")
                    for key in SOAK_LIMITS
                    for h in self.sem.admin.holders(key)
                }
            except SemaphoreBackendError:  # the store just came back: look again
                return False
            found[:] = sorted(set(self.fleet.pool()) & pids)
            return bool(found)

        def any_found() -> bool:
            found[:] = self.fleet.pool()
            return bool(found)

        if not wait_for(holding, timeout=2):
            assert wait_for(any_found, timeout=30), "no pool process to kill"
        victim = self.rng.choice(found)
        with suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        self.killed_pids.add(victim)

    def _stored(self) -> tuple[set[str], set[str], set[str]]:
        """The tasks the store holds: parked in a room, handed a slot, and whose hand-off
        was claimed (plain reads, which a store whose writes are paused still answers)."""
        client = self.store.client()
        parked: set[str] = set()
        handed: set[str] = set()
        claimed: set[str] = set()
        try:
            for key in SOAK_LIMITS:
                keys = redis_keys(self.sem.prefix, key)
                parked.update(map(_text, client.zrange(keys.room, 0, -1)))
                members = map(_text, client.zrange(keys.slots, 0, -1))
                handed.update(m[1:].split("#")[0] for m in members if m.startswith("~"))
                claimed.update(map(_text, client.hkeys(keys.claims)))
        finally:
            client.close()
        return parked, handed, claimed

    def _kill_whole(self, worker: Worker) -> None:
        """Freeze the worker's processes, note which messages are unacknowledged (the worker
        may hold any of them, its results already stored and their acks not yet sent) and
        which unfinished tasks neither the broker nor the store holds, then SIGKILL them all:
        a machine that died.

        kombu's Redis transport takes a message off the queue (BRPOP) before it records it as
        unacknowledged; a worker killed in between loses that one message for good. It is
        among the tasks held nowhere (with any other then in passage, which reappear)."""
        pgid = worker.proc.pid
        with suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGSTOP)
        pids = [pgid, *child_pids(pgid)]
        pending = self.pending()
        queued = _queued_task_ids(self.broker)
        unacked = set(unacked_task_ids(self.broker))
        parked, handed, _ = self._stored()  # after unacked: a run parks, then acknowledges
        stored = parked | handed
        queued |= _queued_task_ids(self.broker)  # a message moves from the queue to unacked
        self.held.append((set(pids), unacked))
        self.lost[POPPED] |= pending - queued - unacked - stored - self.may_miss
        with suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        worker.proc.wait(timeout=30)
        self.killed_pids.update(pids)

    def _victim(self) -> Worker:
        return self.rng.choice(self.fleet.alive())

    def _worker_killed(self) -> None:
        worker = self._victim()
        self._kill_whole(worker)
        self.fleet.start(worker.kind)

    def _worker_stopped(self) -> None:
        """A warm shutdown: running tasks finish, the prefetched go back to the broker. A
        task whose message was out then may run again (at least once): its result may not be
        read in time, and then its delivery is not acknowledged (see :meth:`Fleet.stop_warm`)."""
        worker = self._victim()
        pids = {worker.proc.pid, *child_pids(worker.proc.pid)}
        self.held.append((pids, set(unacked_task_ids(self.broker))))
        self.fleet.stop_warm(worker)
        self.fleet.start(worker.kind)

    def reap(self) -> None:
        """Kill whole a worker whose warm shutdown has taken over a minute."""
        for worker in self.fleet.reap():
            for pid in [worker.proc.pid, *child_pids(worker.proc.pid)]:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR2)  # each prints its stacks in the worker's log
            time.sleep(1.0)
            self._kill_whole(worker)
            del self.fleet.stopping[worker.proc.pid]
            self.counts["stopped workers SIGKILLed after a minute"] += 1

    # -- the store ---------------------------------------------------------------------------

    def _store_frozen(self) -> None:
        self.store.pause()
        time.sleep(FREEZE)  # the fault: frozen for longer than a lease
        self.store.resume()

    def _store_restarted(self) -> None:
        """Stop the store's writes, note what the restart will lose (the rooms, the slots
        handed off, and the claimed hand-offs whose messages are still out), and restart it
        empty."""
        client = self.store.client()
        try:
            client.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
            parked, handed, claimed = self._stored()
            # A message moves from the queue to the unacknowledged: look at the queue twice.
            out = _queued_task_ids(self.broker) | set(unacked_task_ids(self.broker))
            out |= _queued_task_ids(self.broker)
            wipe = (time.monotonic(), time.time())
        finally:
            client.close()
        self.lost[PARKED] |= parked
        self.lost[HANDED] |= handed
        self.lost[CLAIMED] |= claimed & out
        self.store.stop()
        time.sleep(DOWN)  # the fault: down for a moment
        self.store.start()
        self.wipes.append(wipe)
        # The live limits went with everything else, and the workers put back the last they
        # saw (an older one, or none, if the last change came within a sweep of the restart):
        # every worker has ticked twice by then. From the restart on, the code's limit or the
        # one put back applies; then the one put back.
        time.sleep(3 * SWEEP_INTERVAL)
        for key in self.live:
            back = self.sem.admin.live_limit(key)
            answered = time.monotonic()
            self.changes[key].append((wipe[0], answered, SOAK_LIMITS[key]))
            self.changes[key].append((wipe[0], answered, back.limit if back else SOAK_LIMITS[key]))
            self.live[key] = back.limit if back else None

    # -- live limits -------------------------------------------------------------------------

    def limit(self, key: str) -> int:
        live = self.live[key]
        return SOAK_LIMITS[key] if live is None else live

    def set_limit(self, key: str, value: int | None) -> None:
        sent = time.monotonic()
        self.sem.admin.set_limit(key, value)
        self.changes[key].append((sent, time.monotonic(), value or SOAK_LIMITS[key]))
        self.live[key] = value

    def _limit_raised(self) -> None:
        """Up to 3 above the code's limit; back to the code's clears the live limit."""
        options = [(key, n) for key in LIVE_KEYS
                   for n in range(self.limit(key) + 1, SOAK_LIMITS[key] + 4)]  # fmt: skip
        key, n = self.rng.choice(options)
        self.set_limit(key, None if n == SOAK_LIMITS[key] else n)

    def _limit_lowered(self) -> str | None:
        options = [(key, n) for key, floor in LIVE_KEYS.items()
                   for n in range(floor, self.limit(key))]  # fmt: skip
        if not options:  # every key at its lowest already
            self._limit_raised()
            return "limit raised"
        key, n = self.rng.choice(options)
        self.set_limit(key, None if n == SOAK_LIMITS[key] else n)
        return None

    def clear_limits(self) -> None:
        for key, live in self.live.items():
            if live is not None:
                self.set_limit(key, None)

    def schedules(self) -> dict[str, Any]:
        return {key: limit_schedule(SOAK_LIMITS[key], self.changes[key], GRACE)
                for key in SOAK_LIMITS}  # fmt: skip


class Progress:
    """Which tasks have completed a run, read from the bodies' records as they grow."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.seen = 0
        self.done: set[str] = set()
        self.last_end = 0.0

    def update(self) -> set[str]:
        raw = self.client.lrange(history_key(BODIES), self.seen, -1)
        self.seen += len(raw)
        for event in map(json.loads, raw):
            if "end" in event:
                self.done.add(event["task"])
                self.last_end = max(self.last_end, event["end"])
        return self.done


@dataclass
class Plan:
    """What was sent: each task's name, and the weight and seconds of its body."""

    tasks: dict[str, tuple[str, int, float]] = field(default_factory=dict)

    def send(self, app: Celery, rng: random.Random, count: int) -> None:
        names, weights = zip(*MIX.items(), strict=True)
        for _ in range(count):
            name = rng.choices(names, weights)[0]
            seconds = rng.uniform(*BODY)
            units = rng.choice([2, 3]) if name == "csem.soak_heavy" else 1
            args = (len(self.tasks), seconds, units) if units > 1 else (len(self.tasks), seconds)
            result = app.tasks[name].apply_async(args)
            self.tasks[result.id] = (name, units, seconds)

    def ideal(self) -> float:
        """Seconds the bodies need at the least: each key's work (units times seconds of the
        bodies that hold it) over its limit in the code, for the busiest key."""
        work: Counter[str] = Counter()
        for name, units, seconds in self.tasks.values():
            for key in KEYS_OF[name]:
                work[key] += units * seconds
        return max(work[key] / SOAK_LIMITS[key] for key in SOAK_LIMITS)


def _quiet(client: redis.Redis, sem: Semaphore, done: set[str], app: Celery) -> bool:
    """Nothing can start a task that has not run: no message queued, none out for delivery
    (with acks_late a running or held-back task's message is out) but of tasks ``done``,
    whose results are stored (a worker shutting down may hold one it never acknowledged, for
    up to 30 s: see :meth:`Fleet.stop_warm`), nothing parked, no slot held or handed, and
    nothing in the host's journal of parked runs (a run the store lost in a restart waits
    there until a worker's keeper sends it again)."""
    journal = journal_for(app)
    return (
        queued(client) == 0
        and set(unacked_task_ids(client)) <= done
        and all(sem.room.waiters(key) == [] and sem.count(key) == 0 for key in SOAK_LIMITS)
        and (journal is None or not any(True for _ in journal.entries()))
    )


def _states(app: Celery, ids: list[str]) -> dict[str, str]:
    """The stored state of each task (PENDING when none); a failure's is ``FAILURE`` and the
    exception's type, ``FAILURE SemaphoreLeaseLostError``."""
    states: dict[str, str] = {}
    client = app.backend.client
    for at in range(0, len(ids), 1000):
        chunk = ids[at : at + 1000]
        for task_id, raw in zip(chunk, client.mget(map(app.backend.get_key_for_task, chunk)),
                                strict=True):  # fmt: skip
            meta = json.loads(raw) if raw else {"status": "PENDING"}
            state = meta["status"]
            if state == "FAILURE":
                state += f" {(meta.get('result') or {}).get('exc_type', '?')}"
            states[task_id] = state
    return states


def _ended(app: Celery, ids: list[str]) -> set[str]:
    """The tasks among ``ids`` whose result is stored: a success or a failure."""
    return {t for t, state in _states(app, ids).items() if state.split()[0] in READY_STATES}


def _report(
    seed: int,
    plan: Plan,
    chaos: Chaos,
    fleet: Fleet,
    report: Report,
    states: dict[str, str],
    leaked: dict[str, int],
    parked: dict[str, int],
    elapsed: float,
    started: float,
) -> str:
    """The soak's report, as ``-s`` prints it."""
    kinds = Counter(name for name, _, _ in plan.tasks.values())
    faults = chaos.counts
    warm = f" (the longest took {max(fleet.warm_stops):.1f}s)" if fleet.warm_stops else ""
    if fleet.stopping:
        warm += f" ({len(fleet.stopping)} still stopping at the end)"
    excused = sum(report.excused.values())
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(report.excused.items()))
    lost = f"{len(report.missing)}" + (f": {why}" if why else "")
    if report.missing and not report.ok:
        lost += f" ({', '.join(report.missing[:5])})"
    if len(report.missing) > excused:
        lost += f"; {len(report.missing) - excused} not as documented"
    again = ", ".join(f"{n} {reason}" for reason, n in sorted(report.repeated.items()))
    peaks = ", ".join(f"{key} {peak} of {report.limit_of(key)}"
                      for key, peak in sorted(report.peaks.items()))  # fmt: skip
    ideal = plan.ideal()
    lines = [
        f"soak, seed {seed}: {len(plan.tasks)} tasks ({kinds['csem.soak_one']} on one key,"
        f" {kinds['csem.soak_both']} on two, {kinds['csem.soak_heavy']} of weight 2-3, all in"
        f" the waiting room; {kinds['csem.soak_shed']} shedding) over 2 prefork (3 processes"
        " each), 1 solo and 1 threads (4) workers; limits "
        + ", ".join(f"{key} {n}" for key, n in SOAK_LIMITS.items()),
        f"  faults: pool processes SIGKILLed {faults['pool process killed']}, workers SIGKILLed"
        f" whole {faults['worker killed']}, workers stopped warm {faults['worker stopped']}{warm},"
        f" store frozen {faults['store frozen']} ({FREEZE:g}s each), store restarted empty"
        f" {faults['store restarted']}, live limit raised {faults['limit raised']} and lowered"
        f" {faults['limit lowered']}"
        + "".join(f", {what} {n}" for what, n in faults.items() if what not in DECK)
        + f"; worker processes started {sum(fleet.started.values())}",
        f"  peak in flight (slot kept) against the limit: {peaks}",
        f"  tasks lost: {lost}",
        f"  runs duplicated: {sum(report.repeated.values())}" + (f" ({again})" if again else ""),
        f"  runs killed mid-body: {report.unfinished}; runs told their slot was lost:"
        f" {report.lost}; final states: {dict(Counter(states.values()))}",
        f"  slots leaked after the end: {sum(leaked.values())}; runs left parked:"
        f" {sum(parked.values())}",
        f"  time: {elapsed:.1f}s from the first task sent to the last body's end, against an"
        f" ideal {ideal:.1f}s ({elapsed / ideal:.1f}x)",
    ]
    if len(chaos.timeline) <= 3 * len(DECK) or not report.ok:  # a failure needs it whole
        lines.append("  faults at: " + ", ".join(f"+{at - started:.1f}s {what}"
                                                  for at, what in chaos.timeline))  # fmt: skip
    return "\n" + "\n".join(lines)


@contextmanager
def _soak_app(
    redis_server: RedisServer, own_redis: RedisServer, tmp_path: Path
) -> Iterator[tuple[Celery, Fleet]]:
    """Two prefork workers and a solo worker (subprocesses) and a threads worker (here), all
    answering ping when the block starts. The broker and the bodies' records live on one
    server, the slots on another (``own_redis``), which the chaos freezes and restarts."""
    app = add_soak_tasks(make_app(redis_server.url, semaphore_url=own_redis.url,
                                  **AT_LEAST_ONCE))  # fmt: skip
    env = {**os.environ, "CSEM_TEST_REDIS_URL": redis_server.url,
           "CSEM_TEST_SEMAPHORE_URL": own_redis.url, "CSEM_TEST_ACKS_LATE": "1",
           "CSEM_TEST_RECORD_DELIVERIES": "1", "CSEM_TEST_STACKS_ON_SIGUSR2": "1"}  # fmt: skip
    fleet = Fleet(tmp_path, env)
    for kind in ("prefork", "prefork", "solo"):
        fleet.start(kind)
    try:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
            assert wait_for(lambda: len(app.control.ping(timeout=0.5)) >= 4, timeout=90)
            yield app, fleet
    finally:
        fleet.close()
        app.close()


@pytest.mark.soak
def test_soak(
    redis_server: RedisServer,
    own_redis: RedisServer,
    tmp_path: Path,
    soak_tasks: int,
    soak_minutes: float,
    soak_seed: int,
) -> None:
    """Mixed bounded tasks under chaos: see the module's docstring for what is checked."""
    client = redis.Redis.from_url(redis_server.url)
    rng = random.Random(soak_seed)
    plan = Plan()
    progress = Progress(client)
    with _soak_app(redis_server, own_redis, tmp_path) as (app, fleet):
        sem = Semaphore(own_redis.url, limit=1, claim_timeout=SOAK_CLAIM_TIMEOUT,
                        on_handoff=publisher_for(app))  # fmt: skip
        chaos = Chaos(rng, own_redis, client, fleet, sem,
                      lambda: set(plan.tasks) - progress.done)  # fmt: skip
        started = time.monotonic()
        until = started + 60 * soak_minutes if soak_minutes else None
        budget = 60 * soak_minutes + 240 if soak_minutes else 240 + 0.2 * soak_tasks

        def sending() -> bool:
            return time.monotonic() < until if until else len(plan.tasks) < soak_tasks

        pace = rng.randint(*PACE)
        earliest, latest = started + GAP[0], started + GAP[1]
        while sending() or not chaos.dealt_all:
            assert time.monotonic() < started + budget, f"chaos stuck: {dict(chaos.counts)}"
            done = progress.update()
            finished = len(done) + len(chaos.may_miss - done)
            if sending() and len(plan.tasks) - finished < BATCH:
                left = BATCH if until else min(BATCH, soak_tasks - len(plan.tasks))
                plan.send(app, rng, left)
            chaos.reap()
            now = time.monotonic()
            if now >= earliest and (finished >= pace or now >= latest):
                chaos.inject(chaos.next_fault())
                pace = finished + rng.randint(*PACE)
                earliest, latest = time.monotonic() + GAP[0], time.monotonic() + GAP[1]
            time.sleep(0.05)
        chaos.clear_limits()
        # Done when every task is, or when nothing is left that could start one (then the
        # unfinished ones are lost); checked twice, a second apart.
        ids = list(plan.tasks)
        drain = time.monotonic() + 240
        # A body that ended is not a task done: a process killed after the body, before the
        # result was stored, has its message delivered again. So wait on the stored results.
        while not set(ids) <= (ended := _ended(app, ids)):
            assert time.monotonic() < drain, (
                f"the soak did not drain: {Counter(_states(app, ids).values())}"
            )
            chaos.reap()
            if _quiet(client, sem, ended, app):
                time.sleep(1.0)
                if _quiet(client, sem, _ended(app, ids), app):
                    break
            time.sleep(0.2)
        progress.update()
        elapsed = progress.last_end - started
        states = _states(app, ids)
    # Killed runs are run again (at least once): a body killed mid-run never ended, and the
    # task a killed process was running, or a killed worker held unacknowledged, may run twice.
    bodies = History.load(client, BODIES)
    report = bodies.check(
        chaos.schedules(),
        tasks=ids,
        killed_pids=chaos.killed_pids,
        repeats={UNACKED: chaos.unacked(bodies.deliveries)},
        may_lose=MAY_LOSE,
        may_miss=chaos.lost,
        wiped=chaos.wipes,
    )
    settled = wait_for(lambda: all(sem.count(k) == 0 for k in SOAK_LIMITS),
                       timeout=2 * SOAK_LEASE + 10)  # fmt: skip
    leaked = {key: sem.count(key) for key in SOAK_LIMITS if sem.count(key)}
    parked = {key: len(sem.room.waiters(key)) for key in SOAK_LIMITS if sem.room.waiters(key)}
    print(_report(soak_seed, plan, chaos, fleet, report, states, leaked, parked, elapsed,
                  started))  # fmt: skip
    assert report.ok, str(report)
    assert settled, leaked
    assert parked == {}
    assert set(chaos.counts) >= set(DECK), chaos.counts
    # kombu loses at most the one message a worker killed whole had just taken off the queue.
    whole = chaos.counts["worker killed"] + chaos.counts["stopped workers SIGKILLed after a minute"]
    assert report.excused.get(POPPED, 0) <= whole, report.excused
    # A task's state is its last run's: a slot lost in a freeze or a restart fails it. A task
    # a restart took never ran, and keeps its state: PENDING, or RETRY if it was shed before
    # it parked (the store was unreachable); so does one whose body ended in a process killed
    # before its result was stored, if the restart took its second delivery.
    killed_after_body = {r.task_id for r in bodies.completed if r.pid in chaos.killed_pids}

    def explained(task_id: str, state: str) -> bool:
        if state in ("SUCCESS", "FAILURE SemaphoreLeaseLostError"):
            return True
        if state not in ("PENDING", "RETRY"):
            return False
        if task_id in report.missing:  # the checker has judged why
            return True
        return task_id in killed_after_body and task_id in chaos.may_miss

    def account(task_id: str) -> str:
        runs = [r.describe(started) for r in bodies.runs if r.task_id == task_id]
        pids = [pid for t, pid in bodies.deliveries if t == task_id]
        why = [reason for reason, ids in chaos.lost.items() if task_id in ids]
        return (
            f"runs: {runs or 'none'}; delivered to pids {pids}; killed pids among them: "
            f"{sorted(set(pids) & chaos.killed_pids)}; may be lost as {why or 'nothing'}"
        )

    unexplained = {t: state for t, state in states.items() if not explained(t, state)}
    assert unexplained == {}, {t: f"{state}: {account(t)}" for t, state in unexplained.items()}
