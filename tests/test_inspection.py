"""Seeing who holds what: the CLI, celery inspect, worker stats, signals and task events."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Semaphore, SemaphoreLeaseLostError, SemaphoreValidationError
from celery_semaphore import signals as sem_signals
from celery_semaphore.core.calls import acquire_call
from celery_semaphore.core.names import Namespace
from celery_semaphore.core.process import member_of
from celery_semaphore.core.replies import Parked
from celery_semaphore.core.scripts import Scripts
from celery_semaphore.integration.remote import held_by_worker, worker_report
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import prefork_worker_process, wait_for
from .history import BODIES, History

ROOT = Path(__file__).resolve().parent.parent


def celery_cli(url: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CSEM_TEST_REDIS_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.celery_apps", *args],
        cwd=ROOT, env=env, input=stdin, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture
def worker(redis_server: RedisServer) -> Iterator[tuple[Celery, str]]:
    app = make_app(redis_server.url, worker_send_task_events=True)
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False) as w:
        yield app, w.hostname


def test_stats_count_the_runs_parked_and_shed(redis_server: RedisServer, tmp_path: Path) -> None:
    # A prefork worker: the counts are made in its pool processes and read by its main one.
    app = make_app(redis_server.url)
    sem = Semaphore(redis_server.url, limit=3)
    held = [sem.acquire(key) for key in ("queued", "provider") for _ in range(3)]
    assert all(held)
    with prefork_worker_process(app, tmp_path / "worker.log", concurrency=2):
        [hostname] = [name for reply in app.control.ping(timeout=1) for name in reply]

        def counters() -> dict[str, int]:
            stats = app.control.inspect(timeout=5, destination=[hostname]).stats()
            return dict(stats[hostname]["semaphore"]["counters"])

        for n in range(2):
            app.tasks["csem.queued"].delay(n, 0.0)
        shed = app.tasks["csem.provider_call"].delay(9, 0.0)  # shed until a slot frees
        # Counts are written in batches, within about a second: wait for them.
        assert wait_for(lambda: counters()["parked"] == 2, timeout=30), counters()
        assert wait_for(lambda: counters()["shed"] >= 1, timeout=30), counters()
        for slot in held:
            slot.release()  # type: ignore[union-attr]
        shed.get(timeout=60)


def test_status_shows_every_semaphore_and_its_holders(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=3)
    first = sem.acquire("openai", metadata={"task_id": "t-1", "task_name": "tasks.call"})
    second = sem.acquire("tenant:{acme}")
    assert first is not None
    assert second is not None
    text = celery_cli(redis_server.url, "semaphore", "status")
    assert text.returncode == 0, text.stderr
    assert "openai  1/3 in use" in text.stdout
    assert "t-1" in text.stdout
    assert "tasks.call" in text.stdout
    assert "tenant:{acme}  1/3 in use" in text.stdout
    only = celery_cli(redis_server.url, "semaphore", "status", "openai", "--json")
    [view] = json.loads(only.stdout)
    assert view["key"] == "openai"
    assert view["limit"] == 3
    assert view["holders"][0]["metadata"]["task_id"] == "t-1"
    assert 0 < view["holders"][0]["expires_in"] <= 60
    first.release()
    second.release()
    assert "No slot is held." in celery_cli(redis_server.url, "semaphore", "status").stdout


def test_status_shows_the_waiting_room_and_handed_off_slots(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=1, on_handoff=lambda key, handoffs: None)
    holder = sem.acquire("reports")
    assert holder is not None
    sem.room.park("reports", "t-old", b"", arrival=time.time() - 30)
    sem.room.park("reports", "t-new", b"")
    text = celery_cli(redis_server.url, "semaphore", "status")
    assert "reports  1/1 in use, 2 queued (oldest 3" in text.stdout, text.stdout
    [view] = json.loads(celery_cli(redis_server.url, "semaphore", "status", "--json").stdout)
    assert view["queued"] == 2
    assert 29 < view["oldest_wait"] < 120
    assert [w["waiter"] for w in view["waiting"]] == ["t-old", "t-new"]
    assert "waiting, first served first:" in text.stdout, text.stdout
    assert text.stdout.index("t-old") < text.stdout.index("t-new"), text.stdout
    first = celery_cli(redis_server.url, "semaphore", "status", "--waiting", "1")
    assert "waiting, first served first (1 of 2):" in first.stdout, first.stdout
    assert "t-old" in first.stdout
    assert "t-new" not in first.stdout
    holder.release()  # hands the slot to t-old
    text = celery_cli(redis_server.url, "semaphore", "status")
    assert "reports  1/1 in use, 1 queued" in text.stdout, text.stdout
    assert "t-old" in text.stdout
    assert "handed off" in text.stdout


def test_a_dead_holders_unexpired_slot_shows_in_status(redis_server: RedisServer) -> None:
    code = textwrap.dedent(
        f"""
        import time
        from celery_semaphore import Semaphore
        slot = Semaphore({redis_server.url!r}, limit=1, lease=60.0).acquire("orphan")
        print("acquired", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "acquired"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = celery_cli(redis_server.url, "semaphore", "status", "--json").stdout
    [view] = json.loads(out)
    assert view["key"] == "orphan"
    assert view["holders"][0]["metadata"]["pid"] == proc.pid


def test_release_all_asks_then_displaces_a_running_holder(
    worker: tuple[Celery, str], client: redis.Redis, redis_server: RedisServer
) -> None:
    app, _ = worker
    result = app.tasks["csem.lost_raise"].delay()
    assert wait_for(lambda: History.load(client, BODIES).runs, timeout=30)
    refused = celery_cli(redis_server.url, "semaphore", "release-all", "lost-raise", stdin="n\n")
    assert refused.returncode != 0
    assert "Aborted" in refused.stdout + refused.stderr
    done = celery_cli(redis_server.url, "semaphore", "release-all", "lost-raise", "--yes")
    assert done.returncode == 0, done.stderr
    assert "1 live holder(s) displaced" in done.stdout
    with pytest.raises(SemaphoreLeaseLostError):
        result.get(timeout=60)


def test_inspect_and_stats_list_a_held_slot_until_it_is_released(
    worker: tuple[Celery, str], client: redis.Redis, redis_server: RedisServer
) -> None:
    app, hostname = worker
    result = app.tasks["csem.hold_until"].delay("test:go")
    assert wait_for(lambda: client.llen("test:holding") == 1, timeout=30)

    def semaphores() -> Any:
        [reply] = app.control.broadcast("semaphores", reply=True, destination=[hostname], timeout=5)
        return reply[hostname]

    [held] = semaphores()["held"]
    assert held["key"] == "held"
    assert held["task_id"] == result.id
    assert held["task_name"] == "csem.hold_until"
    assert held["pid"] == os.getpid()
    assert 0 < held["expires_in"] <= 60
    # The rooms of the keys it holds: how many wait, the oldest wait, the first in line.
    room = Semaphore(redis_server.url, limit=1).room
    assert isinstance(room.park("held", "next-in-line", b"p"), Parked)
    waiting = semaphores()["waiting"]["held"]
    assert (waiting["queued"], waiting["first"]) == (1, ["next-in-line"])
    assert waiting["oldest_wait"] >= 0
    assert room.cancel("held", "next-in-line")

    # With a destination, inspect returns once that worker answers, not at the timeout.
    stats = app.control.inspect(timeout=5, destination=[hostname]).stats()[hostname]["semaphore"]
    assert [h["task_id"] for h in stats["held"]] == [result.id]
    assert set(stats["counters"]) == {"shed", "parked", "lease_lost", "dead_released", "swept",
                                      "handoffs_missed"}  # fmt: skip

    cli = celery_cli(redis_server.url, "inspect", "semaphores", "--timeout", "5",
                     "--destination", hostname)  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert result.id in cli.stdout

    [view] = json.loads(
        celery_cli(redis_server.url, "semaphore", "status", "held", "--json").stdout
    )
    [holder] = view["holders"]
    assert holder["metadata"]["task_id"] == result.id
    assert holder["metadata"]["worker"] in (hostname, hostname.partition("@")[2])
    watched = celery_cli(redis_server.url, "semaphore", "watch", "held", "--count", "2",
                         "--interval", "0.1")  # fmt: skip
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.count(result.id) == 2

    client.set("test:go", 1)
    assert result.get(timeout=30) == "test:go"
    assert semaphores()["held"] == []
    gone = celery_cli(redis_server.url, "semaphore", "status", "held")
    assert "held  no slot held" in gone.stdout


def test_signals_and_task_events_report_acquire_shed_and_release(
    worker: tuple[Celery, str],
) -> None:
    app, _ = worker
    seen: dict[str, list[dict[str, Any]]] = {"acquired": [], "shed": [], "released": []}
    lock = threading.Lock()

    def recorder(name: str) -> Any:
        def handler(sender: Any = None, **kwargs: Any) -> None:
            with lock:
                seen[name].append({"task": getattr(sender, "name", None), **kwargs})

        return handler

    handlers = {name: recorder(name) for name in seen}
    sem_signals.semaphore_acquired.connect(handlers["acquired"])
    sem_signals.semaphore_shed.connect(handlers["shed"])
    sem_signals.semaphore_released.connect(handlers["released"])
    events: list[dict[str, Any]] = []

    def listen() -> None:
        with app.connection_for_read() as conn:
            receiver = app.events.Receiver(conn, handlers={"*": events.append})
            with contextlib.suppress(Exception):  # the capture's own timeout ends it
                receiver.capture(limit=None, timeout=60, wakeup=False)

    def event_ids(kind: str) -> set[str]:
        return {e["uuid"] for e in list(events) if e.get("type") == kind}

    threading.Thread(target=listen, daemon=True).start()
    task = app.tasks["csem.provider_call"]
    # Events sent before the receiver has bound its queue are lost: wait until one arrives.
    warm: list[Any] = []
    while not wait_for(lambda: event_ids("task-semaphore-acquired") & {r.id for r in warm}, 0.5):
        assert len(warm) < 100, "the event receiver never started"
        warm.append(task.delay(-1, 0))
        warm[-1].get(timeout=30)
    for name in seen:
        seen[name].clear()
    try:
        results = [task.delay(n, 0.2) for n in range(8)]
        [r.get(timeout=60) for r in results]
    finally:
        sem_signals.semaphore_acquired.disconnect(handlers["acquired"])
        sem_signals.semaphore_shed.disconnect(handlers["shed"])
        sem_signals.semaphore_released.disconnect(handlers["released"])
    ids = {r.id for r in results}
    assert len([s for s in seen["acquired"] if s["slot"].token]) >= 8
    assert len(seen["released"]) >= 8
    assert seen["shed"], "8 tasks on a limit of 3 with 4 threads: some must be shed"
    assert all(s["key"] == "provider" and s["limit"] == 3 for s in seen["acquired"])
    assert all(s["held"] >= 0.2 and not s["lost"] for s in seen["released"])
    assert all(s["countdown"] >= 0 and s["sheds"] >= 1 for s in seen["shed"])

    assert wait_for(lambda: ids <= event_ids("task-semaphore-acquired"), timeout=30)
    shed_ids = event_ids("task-semaphore-shed")
    assert shed_ids, "no task-semaphore-shed event"
    assert shed_ids <= ids | {r.id for r in warm}


def test_a_worker_will_not_start_with_a_setting_that_breaks_a_task(
    redis_server: RedisServer,
) -> None:
    # The app-wide heartbeat is above half of csem.long_body's 1 s lease.
    app = make_app(redis_server.url, semaphore_heartbeat=5.0)
    with (
        pytest.raises(SemaphoreValidationError, match=r"task 'csem\.long_body': heartbeat"),
        start_worker(app, pool="solo", perform_ping_check=False),
    ):
        pass


def test_a_worker_will_not_start_with_countdowns_beyond_the_visibility_timeout(
    redis_server: RedisServer,
) -> None:
    app = make_app(redis_server.url, semaphore_shed_max_countdown=3000.0)
    with (
        pytest.raises(SemaphoreValidationError, match="visibility_timeout"),
        start_worker(app, pool="solo", perform_ping_check=False),
    ):
        pass


def _held_keys(url: str, count: int, worker: str) -> None:
    """``count`` keys with a holder each, recorded as held by ``worker``, in a few round
    trips (10,000 acquires one by one would take seconds)."""
    client = redis.Redis.from_url(url)
    scripts, names = Scripts(client), Namespace("semaphore", False)
    member = member_of(json.dumps({"worker": worker, "task_id": "t", "pid": 1}))
    for start in range(0, count, 1000):
        calls = [acquire_call(names.keys_of(f"many:{n}"), 1, 600_000, member)
                 for n in range(start, min(count, start + 1000))]  # fmt: skip
        assert all(not isinstance(r, Exception) for r in scripts.run_many(calls))
    client.close()


def test_a_workers_report_at_ten_thousand_keys_is_whole_or_says_it_is_truncated(
    redis_server: RedisServer,
) -> None:
    """Celery's ``inspect`` waits 1 s for replies: a worker of a store with 10,000 keys
    reads them a page per round trip, and a report the time cut short says so."""
    app = make_app(redis_server.url)
    _held_keys(redis_server.url, 10_000, "other@host")
    sem = Semaphore(redis_server.url, limit=1)
    mine = sem.acquire("mine", metadata={"worker": "me@host", "task_id": "m"})
    assert mine is not None
    report = worker_report(app, "me@host")  # whole, or said to be cut short (a busy machine)
    listed = [h["task_id"] for h in report["held"]]
    assert listed == ["m"] or (report["truncated"] and listed == []), report
    held, truncated = held_by_worker(app, "me@host", within=120.0)
    assert ([h["task_id"] for h in held], truncated) == (["m"], False)
    held, truncated = held_by_worker(app, "me@host", within=0.0)
    assert (held, truncated) == ([], True)
    mine.release()
    app.close()
