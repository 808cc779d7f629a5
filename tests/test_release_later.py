"""Releases sent after the run (the Celery glue's path, ``guard(..., later=True)``): sent at
once by the process's release thread, still sent by a process that ends, put right when
their reply is lost, and left to the lease by a process killed before it sent them; sent
inline, before the run's result, by a prefork pool process (``heartbeat.INLINE``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_semaphore import Semaphore
from celery_semaphore.core import heartbeat, recovery
from celery_semaphore.core import slot as slot_module
from celery_semaphore.core.scripts import Scripts
from celery_semaphore.core.semaphore import guard
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import Published, prefork_worker_process, stop_process, wait_for

ROOT = Path(__file__).resolve().parent.parent


def test_a_release_sent_later_frees_the_slot_and_carries_the_runs_verdict(
    make_semaphore: type[Semaphore],
) -> None:
    sem = make_semaphore(limit=1, lease=60.0)
    slot = sem.acquire("k")
    assert slot is not None
    with guard(slot, 0.5, later=True):
        pass
    assert wait_for(lambda: slot.released, timeout=10)
    assert sem.count("k") == 0
    assert not slot.lost.is_set()


def test_an_interpreter_that_ends_sends_the_releases_it_queued(redis_server: RedisServer) -> None:
    script = textwrap.dedent(f"""
        from celery_semaphore import Semaphore
        from celery_semaphore.core.semaphore import guard
        sem = Semaphore({redis_server.url!r}, limit=500, lease=60.0)
        for _ in range(200):
            with guard(sem.acquire("exit"), None, later=True):
                pass
    """)  # the interpreter ends right after the last hand-off
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=60)
    assert Semaphore(redis_server.url, limit=1).count("exit") == 0


@pytest.fixture(autouse=True)
def release_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The release thread's path, in this process: a solo worker an earlier test ran here
    sent ``worker_process_init``, which makes a process release inline (``INLINE``)."""
    monkeypatch.setattr(heartbeat, "INLINE", False)


@pytest.fixture
def lost_replies(own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A client of the test's own server whose replies a pause of the server loses (a 1 s
    socket timeout: long enough for a loaded machine's replies, short for the test), with
    the recoverer trying again within 0.1 s; the server resumed after the test."""
    monkeypatch.setattr(recovery, "FIRST_TRY", 0.05)
    monkeypatch.setattr(recovery, "MAX_BACKOFF", 0.1)
    client = own_redis.client(socket_timeout=1.0)
    yield client
    own_redis.resume()
    client.close()


def test_a_lost_release_reply_is_put_right_and_its_handoff_published(
    own_redis: RedisServer, published: Published, lost_replies: Any
) -> None:
    sem = Semaphore(lost_replies, limit=1, lease=60.0, on_handoff=published, handoff_grace=0)
    slot = sem.acquire("k")
    assert slot is not None
    sem.room.park("k", "w1", b"payload")
    own_redis.pause()  # the release runs when the store wakes; its reply is lost
    with guard(slot, None, later=True):
        pass
    heartbeat.flush_releases()  # waits for the release thread: the reply timed out
    assert not slot.released
    own_redis.resume()
    assert wait_for(lambda: published.waiters, timeout=30)  # put right, and published
    assert published.waiters == ["w1"]


def _counting_pipelines(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each pipelined round trip the scripts send from now on (each is sent)."""
    sizes: list[int] = []
    run_many = Scripts.run_many

    def counted(self: Scripts, calls: Sequence[Any]) -> list[Any]:
        sizes.append(len(calls))
        return run_many(self, calls)

    monkeypatch.setattr(Scripts, "run_many", counted)
    return sizes


def test_releases_that_come_together_go_in_one_round_trip(
    make_semaphore: type[Semaphore], monkeypatch: pytest.MonkeyPatch
) -> None:
    sem, other = make_semaphore(limit=50, lease=30.0), make_semaphore(limit=50, lease=30.0)
    slots = [sem.acquire(key) for key in ("a", "b") * 10] + [other.acquire("c")]
    sizes = _counting_pipelines(monkeypatch)
    slot_module.give_back([slot for slot in slots if slot is not None])
    assert sizes == [20]  # the lone slot of the other client went on its own
    assert all(slot is not None and slot.released for slot in slots)
    assert sem.count("a") == sem.count("b") == other.count("c") == 0


def test_releases_handed_off_while_one_is_out_go_together_in_the_next_round_trip(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with contextlib.closing(Semaphore(own_redis.url, limit=50, lease=30.0)) as sem:
        slots = [sem.acquire("k") for _ in range(11)]
        sizes = _counting_pipelines(monkeypatch)
        sem.client.execute_command("CLIENT", "PAUSE", 500, "WRITE")
        for slot in slots:  # the first is out (held up by the paused store) as the rest queue
            with guard(slot, None, later=True):
                pass
        heartbeat.flush_releases()
        assert max(sizes) >= 10, sizes
        assert sem.count("k") == 0


def test_a_lost_reply_to_releases_sent_together_puts_each_right(
    own_redis: RedisServer, published: Published, lost_replies: Any
) -> None:
    sem = Semaphore(lost_replies, limit=2, lease=60.0, on_handoff=published, handoff_grace=0)
    slots = [sem.acquire("k"), sem.acquire("k")]
    sem.room.park("k", "w1", b"payload")
    sem.room.park("k", "w2", b"payload")
    own_redis.pause()  # the releases run when the store wakes; their reply is lost
    slot_module.give_back([slot for slot in slots if slot is not None])
    assert not any(slot is not None and slot.released for slot in slots)
    own_redis.resume()
    # Each is put right and its hand-off published (a duplicate copy ends quietly).
    assert wait_for(lambda: set(published.waiters) == {"w1", "w2"}, timeout=30)
    # The slots' holders are gone (those left are the reservations). Not recovery.idle():
    # an earlier test's lost call, whose server is gone, may still be tried in this process.
    tokens = {slot.token for slot in slots if slot is not None}
    assert wait_for(lambda: not {h.token for h in sem.admin.holders("k")} & tokens, timeout=30)


@pytest.fixture
def store(own_redis: RedisServer) -> Iterator[RedisServer]:
    """The semaphore's store, apart from the broker and the results: pausing its writes
    holds up a release and nothing else."""
    yield own_redis
    own_redis.client().execute_command("CLIENT", "UNPAUSE")


@contextlib.contextmanager
def _worker(
    redis_server: RedisServer, store: RedisServer, tmp_path: Path, **env: str
) -> Iterator[tuple[Celery, subprocess.Popen[bytes]]]:
    app = make_app(redis_server.url, semaphore_url=store.url)
    env = {"CSEM_TEST_SEMAPHORE_URL": store.url, **env}
    with prefork_worker_process(app, tmp_path / "worker.log", concurrency=1, env=env) as proc:
        yield app, proc


def test_a_pool_process_that_ends_after_its_run_sends_its_release_first(
    redis_server: RedisServer, store: RedisServer, tmp_path: Path
) -> None:
    # Each pool process runs one task, then ends (max_tasks_per_child): its release, held
    # up by the paused store, must still be sent before it goes.
    with _worker(redis_server, store, tmp_path, CSEM_TEST_MAX_TASKS_PER_CHILD="1") as (app, _):
        pid = _release_held_up(app, store, 1500).get(timeout=60)
        assert wait_for(lambda: not _alive(pid), timeout=30)  # the process is gone...
        assert _held(store) == 0  # ...and its slot was given back first


def test_a_pool_process_sends_its_release_inline_and_one_killed_first_has_it_freed(
    redis_server: RedisServer, store: RedisServer, tmp_path: Path
) -> None:
    with _worker(redis_server, store, tmp_path) as (app, _):
        pid = app.tasks["csem.pause_writes_then_end"].delay(1500).get(timeout=60)
        assert _held(store) == 0  # released before the result was stored
        _release_held_up(app, store, 3000)
        os.kill(pid, signal.SIGKILL)  # the same pool process (-c 1)
        store.client().execute_command("CLIENT", "UNPAUSE")
        # Killed mid-run (its release is part of it now): the worker frees the slot of a run
        # lost so (WorkerLostError), well within the 60 s lease it was left to before.
        assert wait_for(lambda: _held(store) == 0, timeout=30)


def test_a_pool_restart_during_a_runs_release_sends_it_first(
    redis_server: RedisServer, store: RedisServer, tmp_path: Path
) -> None:
    # `celery control pool_restart`: each pool process ends when it is next idle, so one in
    # the middle of its run's release (held up by the paused store) sends it, then goes.
    with _worker(redis_server, store, tmp_path, CSEM_TEST_POOL_RESTARTS="1") as (app, _):
        result = _release_held_up(app, store, 3000)
        replies = app.control.pool_restart(reply=True, timeout=5)
        assert replies
        assert all("ok" in r for answer in replies for r in answer.values())
        pid = result.get(timeout=60)
        assert wait_for(lambda: not _alive(pid), timeout=30)
        assert _held(store) == 0
        # The new pool process runs bounded tasks as before.
        assert app.tasks["csem.pause_writes_then_end"].delay(1).get(timeout=60) != pid
        assert _held(store) == 0


def _writes_paused(store: RedisServer) -> bool:
    """Whether the store holds writes back (``CLIENT PAUSE ... WRITE``): a write then times
    out (it runs when the pause ends)."""
    probe = redis.Redis(
        host="127.0.0.1", port=store.port, socket_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )  # one try: redis-py retries by default
    try:
        probe.set("test:probe", 1)
    except redis.exceptions.TimeoutError:
        return True
    finally:
        probe.close()
    return False


def test_a_worker_shut_down_warm_right_after_a_run_sends_its_release_first(
    redis_server: RedisServer, store: RedisServer, tmp_path: Path
) -> None:
    with _worker(redis_server, store, tmp_path) as (app, proc):
        result = _release_held_up(app, store, 1500)
        stop_process(proc)  # a warm shutdown: the run, its release included, ends first
        pid = result.get(timeout=60)
        assert not _alive(pid)
    assert _held(store) == 0


def _release_held_up(app: Celery, store: RedisServer, ms: int) -> AsyncResult[Any]:
    """Send a run of ``csem.pause_writes_then_end`` that pauses the store's writes for
    ``ms``, and return once its body has ended and its release is held up (the slot still
    held, the store paused)."""
    result = app.tasks["csem.pause_writes_then_end"].delay(ms)
    assert wait_for(lambda: _writes_paused(store), timeout=30)
    assert _held(store) == 1
    return result


def _held(store: RedisServer) -> int:
    """Holders of ``paused-release``, by a plain read (a script would wait out a pause)."""
    sem = Semaphore(store.url, limit=4)
    try:
        return int(sem.client.zcard(sem.names.keys_of("paused-release").slots))
    finally:
        sem.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
