"""Operators' decisions (a pause, a live limit, a live rate) across a restart of the store:
each worker keeps a copy of the store's decisions hash and, when the store comes back without
one (no persistence) or with an older one (a snapshot), puts it back, said in one ERROR line
for the fleet; a decision cleared before the restart is never put back."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Adaptive, Semaphore, SemaphoreAdmin
from celery_semaphore.asyncio import AsyncSemaphoreAdmin
from celery_semaphore.core.names import redis_keys
from celery_semaphore.core.rates import Rate
from celery_semaphore.integration.waiting_room import keeper
from celery_semaphore.integration.waiting_room.keeper import JournalKeeper
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import wait_for
from .test_asyncio import close
from .test_journal import park_journaled

KEEPER = "celery_semaphore.integration.waiting_room.keeper"


@pytest.fixture
def store() -> Iterator[RedisServer]:
    """A store of the test's own, to restart (the broker and backend stay up)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def store_app(redis_server: RedisServer, store: RedisServer) -> Iterator[Celery]:
    app = make_app(redis_server.url, semaphore_url=store.url, semaphore_sweep_interval=0.5)
    yield app
    app.close()


def _admin(store: RedisServer) -> SemaphoreAdmin:
    return SemaphoreAdmin(store.client(), "semaphore")


def _live_rate(store: RedisServer, key: str) -> bytes | None:
    found: bytes | None = store.client().hget(
        redis_keys("semaphore", key).limits, "rate_spec:requests"
    )
    return found


def _lost_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == KEEPER and r.levelno >= 40]


def _restart(store: RedisServer, persistence: str) -> None:
    # SIGKILL: the server comes back from the snapshot SAVE wrote, or empty without one.
    store.stop(kill=persistence == "snapshot")
    store.start()


@pytest.mark.parametrize("persistence", ["none", "snapshot"])
def test_a_restart_of_the_store_loses_no_decision_and_brings_back_no_cleared_one(
    persistence: str, store: RedisServer, store_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Proves: a pause, a live limit and a live rate set before a restart of the store are
    its again after the workers' next tick, whether the store came back empty or from a
    snapshot taken before they were set; each is said in one ERROR line naming the key, the
    decision, who and when, however many workers put it back; and a pause resumed before the
    restart stays resumed, even when the snapshot still has it paused."""
    admin = _admin(store)
    assert admin.pause("dec:resumed", by="ops") is False
    if persistence == "snapshot":
        assert store.client().save()
    assert admin.resume("dec:resumed", by="ops") is True
    admin.pause("dec:paused", by="ops")
    admin.set_limit("dec:limited", 1, by="ops")
    admin.set_rate("dec:rated", "2/s", by="ops")
    workers = [JournalKeeper(store_app), JournalKeeper(store_app)]  # two workers of a fleet
    for worker in workers:
        worker.keep()

    _restart(store, persistence)
    assert admin.pause_of("dec:paused") is None
    assert admin.live_limit("dec:limited") is None
    assert (admin.pause_of("dec:resumed") is not None) is (persistence == "snapshot")
    caplog.set_level(logging.INFO)
    for _ in range(2):
        for worker in workers:
            worker.keep()

    paused = admin.pause_of("dec:paused")
    assert paused is not None
    assert paused.by == "ops"
    live = admin.live_limit("dec:limited")
    assert live is not None
    assert (live.limit, live.by) == (1, "ops")
    assert _live_rate(store, "dec:rated") == b"2/s burst 1"
    assert admin.pause_of("dec:resumed") is None
    lines = _lost_lines(caplog)
    expected = ["'dec:paused': a restart of the store lost its pause, set by ops at",
                "'dec:limited': a restart of the store lost its live limit 1, set by ops at",
                "'dec:rated': a restart of the store lost its live requests rate 2/s burst 1, "
                "set by ops at"]  # fmt: skip
    if persistence == "snapshot":
        expected.append("'dec:resumed': a restart of the store lost its pause, cleared by ops at")
    assert len(lines) == len(expected), lines
    for line, start in zip(sorted(lines), sorted(expected), strict=True):
        assert line.startswith(f"semaphore {start}"), (line, start)
        assert "put back by" in line or "cleared again by" in line


def test_a_decision_made_after_the_restart_is_left_alone(
    store: RedisServer, store_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Proves: a worker puts back no decision an operator changed since the restart (the
    store's is newer than its copy), and one that starts after the restart puts back
    nothing (it has no copy older than the store's)."""
    admin = _admin(store)
    admin.pause("dec:paused", by="ops")
    admin.set_limit("dec:limited", 2, by="ops")
    worker = JournalKeeper(store_app)
    worker.keep()
    _restart(store, "none")
    admin.set_limit("dec:limited", 5, by="ops2")
    late = JournalKeeper(store_app)
    late.keep()
    assert admin.pause_of("dec:paused") is None  # the late worker had no copy
    worker.keep()
    paused = admin.pause_of("dec:paused")
    assert paused is not None
    assert paused.by == "ops"
    live = admin.live_limit("dec:limited")
    assert live is not None
    assert (live.limit, live.by) == (5, "ops2")
    assert len(_lost_lines(caplog)) == 1


def test_the_newest_copy_of_the_fleet_wins_whichever_worker_puts_back_first(
    store: RedisServer, store_app: Celery
) -> None:
    """Proves: a worker whose copy is older (it last ticked before the limit's last change)
    puts back its value first, and a worker with the newest copy still puts back the newest:
    a put-back decision keeps its entry (and its time) as it was."""
    admin = _admin(store)
    stale, fresh = JournalKeeper(store_app), JournalKeeper(store_app)
    admin.set_limit("dec:limited", 5, by="ops")
    stale.keep()
    admin.set_limit("dec:limited", 7, by="ops2")
    fresh.keep()
    _restart(store, "none")
    stale.keep()
    live = admin.live_limit("dec:limited")
    assert live is not None
    assert live.limit == 5
    fresh.keep()
    stale.keep()
    live = admin.live_limit("dec:limited")
    assert live is not None
    assert (live.limit, live.by) == (7, "ops2")


def test_the_admins_record_each_decision_and_its_clear(store: RedisServer) -> None:
    """Proves: the sync and the asyncio admin record each decision in the decisions hash,
    and a clear as a value of None, with who and when."""

    async def decide() -> None:
        client = aioredis.Redis.from_url(store.url)
        try:
            admin = AsyncSemaphoreAdmin(client, "semaphore")
            await admin.pause("dec:async", by="ops")
            await admin.set_rate("dec:async", "3/s", by="ops")
        finally:
            await close(client)

    asyncio.run(decide())
    _admin(store).set_limit("dec:sync", 4, by="ops")
    _admin(store).set_limit("dec:sync", None, by="ops2")
    found = {
        k.decode(): json.loads(v) for k, v in store.client().hgetall("semaphore:decisions").items()
    }
    assert sorted(found) == ["limit dec:sync", "pause dec:async", "rate:requests dec:async"]
    assert found["pause dec:async"][:2] == [True, "ops"]
    assert found["rate:requests dec:async"][:2] == [["3/s", 1], "ops"]
    assert found["limit dec:sync"][:2] == [None, "ops2"]


def test_a_worker_puts_back_a_pause_the_store_lost_within_a_few_sweeps(
    store: RedisServer, store_app: Celery
) -> None:
    """Proves: a real worker's upkeep puts back a pause a restart of the store (without
    persistence) lost, within a few sweep intervals."""
    admin = _admin(store)
    admin.pause("dec:paused", by="ops")
    with start_worker(store_app, pool="threads", concurrency=1, perform_ping_check=False):
        # The fleet's scan lease is taken after the keeper's first tick: the copy is made.
        assert wait_for(lambda: store.client().exists("semaphore:rooms:scan"), timeout=30)
        _restart(store, "none")
        assert wait_for(lambda: admin.pause_of("dec:paused") is not None, timeout=30)
    paused = admin.pause_of("dec:paused")
    assert paused is not None
    assert paused.by == "ops"


def test_the_runs_a_restart_lost_are_counted_in_one_line_per_key_for_the_fleet(
    store: RedisServer,
    store_app: Celery,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Proves: when the store restarts without its rooms, the fleet says once, in one ERROR
    line per key, how many runs the room held before the restart (5), how many the journals
    sent again (the 2 this host journaled) and how many are left over (3, parked by hosts
    whose journals are not here), however many workers see it and however many ticks they
    take, naming the hosts listed before the restart that keep no journal or have not
    ticked since; the runs sent again are each said at INFO only. (Before: a line per worker per
    tick that sent runs, each with its own count, and no word of the others.)"""
    monkeypatch.setattr(keeper, "REPORT_AFTER", 1.0, raising=False)
    sem = Semaphore(store.url, limit=1)
    assert sem.acquire("loss:k") is not None
    park_journaled(store_app, sem, "loss:k", 5, journaled=2)  # 2 journaled by this host
    workers = [JournalKeeper(store_app), JournalKeeper(store_app)]  # two workers of a fleet
    for worker in workers:
        worker.keep()
    # Two more hosts of the fleet tick before the restart: one with no journal, and one that
    # is gone (with its journal) by the time the store comes back.
    bare = make_app(store_app.conf.broker_url, semaphore_url=store.url, semaphore_journal=False)
    request.addfinalizer(bare.close)
    for host, app in (("bare-host", bare), ("gone-host", store_app)):
        with monkeypatch.context() as m:
            m.setattr(socket, "gethostname", lambda host=host: host)
            JournalKeeper(app).keep()
    for worker in workers:  # the hosts as listed before the restart, as a worker sees them
        worker.keep()
    _restart(store, "none")
    caplog.set_level(logging.INFO)

    def said() -> list[str]:
        for worker in workers:
            worker.keep()
        return [line for line in _lost_lines(caplog) if "'loss:k'" in line]

    assert wait_for(lambda: len(said()) >= 1, timeout=30)
    for _ in range(3):  # more ticks of both: nothing more is said
        said()
    assert said() == [
        "semaphore 'loss:k': a restart of the store lost runs of its waiting room: it held 5 "
        "at the last look before the restart and 0 after; the hosts' journals sent 2 again; "
        "the other 3 were parked by hosts whose journals are not here (no journal, or no "
        "worker of theirs running: bare-host (no journal), gone-host (not seen since)), and "
        "are lost"
    ]
    resent = [r for r in caplog.records if "sent lost run" in r.getMessage()]
    assert [r.levelno for r in resent] == [logging.INFO] * 2


def test_a_store_restored_from_an_older_snapshot_gives_back_the_rate_units_taken_since(
    store: RedisServer,
) -> None:
    """Proves the guarantees table's cell for a rate's state after a restart from an older
    snapshot: the rate's state is the snapshot's, so the units taken since it are free again
    (here 2 of a burst of 3 at 1/m: 5 starts within the minute where 3 would be allowed)."""
    sem = Semaphore(store.url, limit=10, rate=Rate("1/m", burst=3))
    first = sem.acquire("snap:rated")
    assert first is not None
    assert store.client().save()  # the snapshot: one unit of the burst taken
    since = [sem.acquire("snap:rated") for _ in range(3)]
    assert [slot is not None for slot in since] == [True, True, False]  # the burst is spent
    for slot in (first, *since):
        if slot is not None:
            slot.release()
    _restart(store, "snapshot")
    again = [sem.acquire("snap:rated") for _ in range(3)]
    assert [slot is not None for slot in again] == [True, True, False]
    sem.client.close()


def test_a_store_restored_from_an_older_snapshot_forgets_a_later_cool_down(
    store: RedisServer,
) -> None:
    """Proves the guarantees table's cell for provider feedback after a restart from an
    older snapshot: a back-off made since the snapshot is gone with it (no cool-down, the
    adaptive limit as the snapshot had it), as a restart without persistence would do."""
    sem = Semaphore(store.url, limit=Adaptive(initial=4, min=1, max=8))
    assert store.client().save()
    slot = sem.acquire("snap:adaptive")
    assert slot is not None
    assert slot.back_off(retry_after=60) > time.time() + 30  # cooling for a minute
    assert sem.acquire("snap:adaptive") is None
    _restart(store, "snapshot")
    feedback = SemaphoreAdmin(store.client(), "semaphore").feedback("snap:adaptive")
    assert sem.acquire("snap:adaptive") is not None, feedback
    sem.client.close()
