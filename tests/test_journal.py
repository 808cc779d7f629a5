"""The journal keeper's judgement of one entry, against a real store and broker: which runs it
sends again after a restart of the store, and which it leaves alone. (The whole story, a
store restarted under parked runs, is in tests/test_room_faults.py.)"""

from __future__ import annotations

import json
import logging
import os
import pwd
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu.serialization import dumps

from celery_semaphore import Semaphore, Slot
from celery_semaphore.integration.settings import app_settings, journal_for
from celery_semaphore.integration.waiting_room.incarnation import checked_incarnation
from celery_semaphore.integration.waiting_room.journal import Journal, default_directories
from celery_semaphore.integration.waiting_room.keeper import SETTLE, JournalKeeper
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import queued

KEY = "journaled"


def _payload(app: Celery, task_id: str) -> bytes:
    """A parked run's payload, as parking writes it: a signature of ``csem.gate``."""
    signature = app.signature("csem.gate", args=(1,), task_id=task_id)
    content_type, encoding, body = dumps(dict(signature), serializer="json")  # type: ignore[no-untyped-call]
    data = body.encode(encoding) if isinstance(body, str) else body
    return f"{content_type}\n{encoding}\n".encode() + data


def _journaled(app: Celery, stamp: str, age: float) -> str:
    """A run journaled ``age`` seconds ago under incarnation ``stamp``, parked in no room."""
    task_id = str(uuid.uuid4())
    journal = journal_for(app)
    assert journal is not None
    journal.record(task_id, [KEY], _payload(app, task_id), stamp, at=time.time() - age)
    return task_id


def park_journaled(
    app: Celery, sem: Semaphore, key: str, count: int, journaled: int | None = None
) -> list[str]:
    """Park ``count`` runs of ``csem.gate`` on ``key`` (which the caller holds full) and
    journal the first ``journaled`` of them (None: all) on this host, long enough ago to be
    judged at once; their task ids."""
    journal = journal_for(app)
    assert journal is not None
    stamp = checked_incarnation(sem.client, sem.prefix)
    parked = [str(uuid.uuid4()) for _ in range(count)]
    for n, task_id in enumerate(parked):
        payload = _payload(app, task_id)
        assert not isinstance(sem.room.park(key, task_id, payload), Slot)
        if journaled is None or n < journaled:
            journal.record(task_id, [key], payload, stamp, at=time.time() - 2 * SETTLE)
    return parked


def _entries(app: Celery) -> list[str]:
    journal = journal_for(app)
    assert journal is not None
    return [entry.waiter for entry in journal.entries()]


@pytest.fixture
def current(app: Celery, client: redis.Redis) -> str:
    """The store's incarnation now (the tests' store restarted, as far as older stamps go)."""
    for entry in _entries(app):
        journal_for(app).forget(entry)  # type: ignore[union-attr]
    client.delete("celery", "celery.handoff")
    return checked_incarnation(client, app_settings(app).prefix)


def test_a_run_the_store_lost_is_sent_again(app: Celery, client: redis.Redis, current: str) -> None:
    """Proves: a settled entry of an older incarnation, whose run no room holds and no
    backend has finished, is sent again once, and struck out."""
    task_id = _journaled(app, "older|run", age=2 * SETTLE)
    JournalKeeper(app).keep()
    assert _entries(app) == []
    JournalKeeper(app).keep()
    sent = [json.loads(raw)["headers"]["id"] for raw in client.lrange("celery", 0, -1)]
    assert sent == [task_id]


def test_a_run_finished_before_the_restart_is_not_sent_again(
    app: Celery, client: redis.Redis, current: str
) -> None:
    """Proves: a run another host served before the store restarted (its claim lost with
    the store, its result stored) is struck out, not sent again."""
    task_id = _journaled(app, "older|run", age=2 * SETTLE)
    app.backend.mark_as_done(task_id, 1)
    JournalKeeper(app).keep()
    assert _entries(app) == []
    assert queued(client) == 0


@pytest.mark.parametrize("older", [True, False])
def test_a_run_journaled_moments_ago_is_left_alone(
    app: Celery, client: redis.Redis, current: str, older: bool
) -> None:
    """Proves: an entry younger than SETTLE whose run is in no room (its park may still be
    on its way) is neither sent again nor struck out, whatever its stamp."""
    task_id = _journaled(app, "older|run" if older else current, age=0.0)
    JournalKeeper(app).keep()
    assert _entries(app) == [task_id]
    assert queued(client) == 0


def test_many_threads_of_a_process_share_its_one_journal_connection(tmp_path: Path) -> None:
    """Under gevent or eventlet every task is a green thread of its own: the journal serves
    them all from the process's one connection (a connection per thread was opened and set
    up anew on every park there), and every write lands."""
    journal = Journal(tmp_path / "journal.sqlite3")
    journal.forget("nobody")  # opened once: threads that race to open it first may each open one
    opened: list[object] = []

    def park_some(n: int) -> None:
        for i in range(50):
            journal.record(f"w{n}-{i}", ["k"], b"payload", "inc")
        with journal._db() as db:
            opened.append(db)

    threads = [threading.Thread(target=park_some, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({entry.waiter for entry in journal.entries()}) == 400
    assert len({id(db) for db in opened}) == 1


def test_a_home_that_is_no_directory_puts_the_journal_in_the_temporary_directory(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves: with the default setting and a HOME that is a file (a locked-down container),
    the journal goes to a directory of the user's own in the temporary directory."""
    home = tmp_path / "home"
    home.write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    app = make_app(redis_server.url, semaphore_journal=True)
    journal = journal_for(app)
    assert journal is not None
    assert journal.path.parent == Path(tempfile.gettempdir()) / f"celery-semaphore-{os.getuid()}"


@pytest.mark.skipif(os.geteuid() != 0, reason="takes an arbitrary uid, as root can")
def test_a_user_with_no_home_and_no_passwd_entry_gets_a_journal_directory() -> None:
    """Proves: an arbitrary uid with no passwd entry and no HOME (OpenShift's) is given a
    directory, where ``Path.home()`` raises."""
    uid = next(n for n in range(54_321, 60_000) if not _has_passwd_entry(n))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: that uid, no HOME
        try:
            os.environ.pop("HOME", None)
            os.environ.pop("XDG_STATE_HOME", None)
            os.setuid(uid)
            os.write(write, json.dumps([str(p) for p in default_directories()]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        found = answer.read()
    os.waitpid(pid, 0)
    assert json.loads(found) == [str(Path(tempfile.gettempdir()) / f"celery-semaphore-{uid}")]


def _has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_a_journal_that_cannot_be_written_is_said_once_and_no_park_says_it_again(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Proves: a journal directory that cannot be made (even by root: it would sit under a
    file) is said in one WARNING line when the worker starts, the start-up line says there
    is no journal, and the runs that park say nothing more."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    app = make_app(redis_server.url, semaphore_journal=str(blocker / "journals"))
    with (
        caplog.at_level(logging.INFO, logger="celery_semaphore"),
        start_worker(app, pool="threads", concurrency=4, perform_ping_check=False),
    ):
        runs = [app.tasks["csem.queued"].delay(n, 0.3) for n in range(8)]  # limit 3: some park
        assert sorted(r.get(timeout=60) for r in runs) == list(range(8))
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "journal" in r.getMessage()]
    warned = [m for level, m in said if level >= logging.WARNING]
    assert len(warned) == 1, said
    assert warned[0].startswith("semaphore_journal: no journal of parked runs can be written")
    assert str(blocker / "journals") in warned[0]
    assert any("no journal of parked runs can be written on this host (see the warning" in m
               for _, m in said), said  # fmt: skip
