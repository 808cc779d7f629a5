"""Helpers for the tests: workers and their processes, threads, polling, the broker's state.

What bodies ran is recorded and checked by tests/history.py, without the library's help."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from kombu.exceptions import OperationalError

from celery_semaphore.core.replies import Handoff
from celery_semaphore.integration.waiting_room.queues import SUFFIX
from celery_semaphore.views.cli import semaphore as semaphore_cli

from . import history
from .history import BODIES

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: object, timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Poll ``predicate()`` until it is truthy or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return bool(predicate())  # type: ignore[operator]


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM ``proc`` (a worker shuts down warm), and SIGKILL it if it is still up after
    ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def prefork_worker_process(
    app: Any, log: Path, concurrency: int = 4, env: dict[str, str] | None = None,
    pool: str = "prefork",
) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """A ``celery -A tests.celery_apps worker -P prefork`` subprocess on ``app``'s broker
    (or another ``pool``: gevent, eventlet), ready (answering ping) when the block starts,
    shut down warm when it ends."""
    name = f"{pool}-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    command = [sys.executable, "-m", "celery", "-A", "tests.celery_apps", "worker",
               "-P", pool, "-c", str(concurrency), "-n", name, "--loglevel=INFO",
               "--without-gossip", "--without-mingle"]  # fmt: skip
    full_env = {**os.environ, "CSEM_TEST_REDIS_URL": app.conf.result_backend, **(env or {})}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_until_ready(app, proc, name, log)
        yield proc
    finally:
        stop_process(proc)


def wait_until_ready(
    app: Any, proc: subprocess.Popen[bytes], name: str, log: Path, timeout: float = 60
) -> None:
    """Wait until worker ``name`` (the process ``proc``, writing ``log``) answers a ping;
    fail with its log if it ends first or does not answer within ``timeout`` seconds."""
    ready = wait_for(lambda: proc.poll() is not None or _answers(app, name), timeout=timeout)
    assert ready, log.read_text()
    assert proc.poll() is None, log.read_text()


def _answers(app: Any, name: str) -> bool:
    """Whether worker ``name`` answers a ping; a broker that drops the connection meanwhile
    (RabbitMQ resets one now and then while many tests connect at once; kombu's Redis
    transport lets redis-py's ConnectionError through from a BRPOP it starts on a pooled
    connection the server closed) counts as not yet."""
    try:
        return bool(app.control.ping(destination=[name], timeout=0.5))
    except (OSError, OperationalError, redis.exceptions.ConnectionError):
        return False


def kill_worker(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a prefork worker: its main process, then each pool process."""
    children = child_pids(proc.pid)
    proc.kill()
    proc.wait()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_in_threads(target: Any, count: int) -> None:
    """Run ``target()`` in ``count`` threads at once and wait for all of them."""
    threads = [threading.Thread(target=target) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def assert_force_release_is_reported(sem: Any, admin: Any) -> None:
    """``sem`` (lease 2 s) holds a slot of "shared" while ``admin`` frees every slot: the
    holder's next renewal must report the loss, and ``hold`` must raise."""
    from celery_semaphore import SemaphoreLeaseLostError

    with pytest.raises(SemaphoreLeaseLostError), sem.hold("shared", heartbeat=0.2) as slot:
        assert admin.force_release_all("shared") == 1
        assert slot.lost.wait(10), "the heartbeat never noticed the slot was gone"
    assert "gone" in str(slot.lease_lost_error())
    assert admin.force_release_all("shared") == 0


def run_callers(sem: Any, key: str, recorder: Any, callers: int) -> list[str]:
    """``callers`` threads at once, each running one body through ``sem.run(key, ...)``
    (retrying until it has a slot); each body records its run, as task ``caller-<n>``, in the
    history :data:`BODIES` through ``recorder``. Fails on any caller's error; returns the
    callers' task ids."""
    errors: list[BaseException] = []
    numbers = itertools.count()

    def caller() -> None:
        task_id = f"caller-{next(numbers)}"

        def body(slot: Any) -> None:
            with history.run(recorder, BODIES, key, task_id=task_id, slot=slot):
                time.sleep(0.01)  # the body's own work, not a synchronisation wait

        try:
            sem.run(key, body, retries=10_000, retry_delay=0.005)
        except BaseException as exc:
            errors.append(exc)

    run_in_threads(caller, callers)
    assert errors == []
    return [f"caller-{n}" for n in range(callers)]


def acquire_at_once(sem: Any, key: str, callers: int) -> list[Any]:
    """``callers`` threads released together by a barrier, each trying ``sem.acquire(key)``
    once; what each got (a Slot or None)."""
    barrier = threading.Barrier(callers)
    results: list[Any] = []
    lock = threading.Lock()

    def caller() -> None:
        barrier.wait()
        slot = sem.acquire(key)
        with lock:
            results.append(slot)

    run_in_threads(caller, callers)
    return results


def spearman(order: list[int]) -> float:
    """Spearman's rank correlation of ``order`` (distinct values) with its sorted self: 1.0
    when every run started in the order it asked, lower the more they were shuffled."""
    n = len(order)
    if n < 2:
        return 1.0
    ranks = {value: rank for rank, value in enumerate(sorted(order))}
    moved = sum((ranks[value] - position) ** 2 for position, value in enumerate(order))
    return 1 - 6 * moved / (n * (n * n - 1))


def child_pids(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (a prefork worker's pool processes)."""
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


QUEUES = ("celery", "celery" + SUFFIX)
"""Where a task's message waits in the tests' Redis broker: the default queue, and beside it
the hand-off queue workers consume for it."""


def queued(client: Any) -> int:
    """How many task messages wait in the broker (``client``), in :data:`QUEUES`."""
    return sum(int(client.llen(queue)) for queue in QUEUES)


def unacked_task_ids(client: Any) -> list[str]:
    """The task ids of the messages a Redis broker (``client``) has delivered and not yet
    had acknowledged (kombu's ``unacked`` hash): prefetched by a worker, running with
    ``acks_late``, or stranded by a worker that died."""
    import json

    ids = []
    for raw in client.hvals("unacked"):
        message = json.loads(raw)[0]
        ids.append(str((message.get("headers") or {}).get("id")))
    return sorted(ids)


class Published:
    """Records what a semaphore hands off, in order."""

    def __init__(self) -> None:
        self.handoffs: list[tuple[str, str, bytes]] = []
        self.give_ups: list[str] = []
        self.made: list[Handoff] = []  # the hand-offs themselves (a start rate's delay)

    def __call__(self, key: str, handoffs: Sequence[Handoff]) -> None:
        self.made.extend(h for h in handoffs if not h.give_up)
        self.handoffs.extend((key, h.waiter, h.payload) for h in handoffs if not h.give_up)
        self.give_ups.extend(h.waiter for h in handoffs if h.give_up)

    @property
    def waiters(self) -> list[str]:
        return [waiter for _, waiter, _ in self.handoffs]


AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
"""The machine's RabbitMQ, for the tests that show a non-Redis broker."""


def rabbitmq_up() -> bool:
    """Whether RabbitMQ answers on 127.0.0.1:5672 (the tests that need it skip otherwise)."""
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
    except OSError:
        return False
    return True


def cli(app: Any, *args: str) -> str:
    """What ``celery semaphore <args>`` prints for ``app``, which must exit 0."""
    ctx = type("Ctx", (), {"app": app})()
    out = CliRunner().invoke(semaphore_cli, list(args), obj=ctx)
    assert out.exit_code == 0, out.output
    return out.output


def delete_queues(app: Any, queues: Iterable[str], exchanges: Iterable[str] = ()) -> None:
    """Delete ``queues`` and ``exchanges`` on ``app``'s broker: a shared RabbitMQ keeps what
    a test declared, and a later test that declares the same name differently fails."""
    with app.connection_for_write() as connection:
        for name in queues:
            connection.default_channel.queue_delete(name)
        for name in exchanges:
            connection.default_channel.exchange_delete(name)
