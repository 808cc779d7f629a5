"""The journal keeper's judgement of one entry, against a real store and broker: which runs it
sends again after a restart of the store, and which it leaves alone. (The whole story, a
store restarted under parked runs, is in tests/test_room_faults.py.)"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from celery import Celery
from kombu.serialization import dumps

from celery_semaphore.integration.settings import app_settings, journal_for
from celery_semaphore.integration.waiting_room.incarnation import checked_incarnation
from celery_semaphore.integration.waiting_room.journal import Journal
from celery_semaphore.integration.waiting_room.keeper import SETTLE, JournalKeeper

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
