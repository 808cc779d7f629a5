"""Pausing a key for the whole fleet (``celery semaphore pause``, ``SemaphoreAdmin.pause``):
running holders finish and renew, nothing new starts, parked runs wait, and a resume hands
the free slots to the oldest parked runs at once. On a real redis-server, with a real worker
for the Celery side."""

from __future__ import annotations

import asyncio

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import (
    Refusal,
    Semaphore,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.core.names import redis_keys
from celery_semaphore.core.replies import Parked
from celery_semaphore.core.slot import Slot
from celery_semaphore.integration.waiting_room.handoffs import publisher_for
from celery_semaphore.testing import RedisServer

from .helpers import Published, cli, wait_for
from .history import BODIES, History


def test_a_paused_key_refuses_new_holders_keeps_running_ones_and_hands_off_on_resume(
    redis_server: RedisServer,
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=2, on_handoff=published)
    running = sem.acquire("k")
    assert running is not None
    assert sem.admin.pause("k", by="ops") is False  # it was not paused before
    assert sem.admin.pause("k") is True  # a second pause keeps the first one's record
    paused = sem.admin.pause_of("k")
    assert paused is not None
    assert paused.by == "ops"
    assert sem.acquire("k") is None  # a slot is free, but nothing new starts
    with pytest.raises(SemaphoreNotAcquiredError) as refused, sem.hold("k"):
        pass
    assert refused.value.reason is Refusal.PAUSED
    assert running.extend()  # the running holder keeps renewing
    sem.room.park("k", "first", b"p")
    sem.room.park("k", "second", b"p")
    assert running.release()
    assert published.waiters == []  # a release hands nothing off while paused
    sem.admin.set_limit("k", 5)
    sem.admin.set_limit("k", None)  # clearing the live limit leaves the pause alone
    assert sem.admin.pause_of("k") is not None
    assert sem.admin.resume("k", by="ops") is True
    assert published.waiters == ["first", "second"]  # oldest first, at once
    assert sem.admin.pause_of("k") is None
    assert sem.admin.resume("k") is False  # not paused: nothing to do
    sem.client.close()


def test_a_run_handed_its_slot_before_a_pause_starts_only_after_the_resume(
    redis_server: RedisServer,
) -> None:
    # Its hand-off was published before the pause, and its message comes during it (behind
    # a broker backlog, or held for a start rate's instant): the run must not start.
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    held = sem.acquire("k")
    assert held is not None
    sem.room.park("k", "late", b"p")
    assert held.release()
    assert published.waiters == ["late"]
    sem.admin.pause("k")
    assert isinstance(sem.room.claim("k", "late"), Parked)  # back in the room, at its place
    assert sem.count("k") == 0  # its reservation went back
    assert [w.waiter for w in sem.room.waiters("k")] == ["late"]
    sem.admin.resume("k")
    assert published.waiters == ["late", "late"]  # the resume hands it out again
    slot = sem.room.claim("k", "late")
    assert isinstance(slot, Slot)
    assert slot.release()
    sem.client.close()


def test_a_resume_keeps_a_live_limit_and_a_pause_survives_one(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=3)
    sem.admin.set_limit("k", 1)
    sem.admin.pause("k")
    assert sem.admin.set_limit("k", 2) == 1  # a new live limit while paused
    assert sem.acquire("k") is None
    sem.admin.resume("k")
    live = sem.admin.live_limit("k")
    assert live is not None
    assert live.limit == 2
    slots = [sem.acquire("k") for _ in range(3)]
    assert [s is not None for s in slots] == [True, True, False]
    for slot in slots:
        if slot is not None:
            slot.release()
    sem.client.close()


@pytest.mark.parametrize(("key", "by"), [("", None), ("k", ""), (5, None), ("k", 7)])
def test_bad_pause_arguments_are_refused_before_anything_is_written(
    key: object, by: object, redis_server: RedisServer, client: redis.Redis
) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    for change in (sem.admin.pause, sem.admin.resume):
        with pytest.raises(SemaphoreValidationError):
            change(key, by)  # type: ignore[arg-type]
    assert client.keys("*") == []
    sem.client.close()


def test_the_asyncio_admin_pauses_and_resumes_for_sync_callers_too(
    redis_server: RedisServer,
) -> None:
    sync = Semaphore(redis_server.url, limit=1)

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            assert await sem.admin.pause("k", by="async ops") is False
            assert sync.acquire("k") is None
            with pytest.raises(SemaphoreNotAcquiredError) as refused:
                async with sem.hold("k"):
                    pass
            assert refused.value.reason is Refusal.PAUSED
            paused = await sem.admin.pause_of("k")
            assert paused is not None
            assert paused.by == "async ops"
            assert await sem.admin.resume("k") is True
            async with sem.hold("k"):
                pass

    asyncio.run(main())
    sync.client.close()


def test_a_paused_key_parks_a_workers_runs_and_resume_starts_them_oldest_first(
    app: Celery, client: redis.Redis
) -> None:
    """Proves, with a real worker and the CLI: while the key is paused its runs park though
    slots are free, a body already running finishes, status says who paused it; resume
    hands the free slots to the oldest parked runs at once.

    The order is read off the room, not off the bodies' starts: three runs handed slots in
    one call start in whatever order their threads get them."""
    task = app.tasks["csem.queued"]
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    running = sem.acquire("queued")  # a body already running: it keeps its slot
    assert running is not None
    assert "Paused 'queued'" in cli(app, "pause", "queued", "--by", "ops on call")
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        results = []
        for n in range(4):
            # The first three hold their slots long enough for the room to be read after
            # resume: the fourth can be handed a slot only when one of them ends.
            results.append(task.delay(n, 3.0 if n < 3 else 0.0))
            assert wait_for(lambda n=n: len(sem.room.waiters("queued")) == n + 1, timeout=30)
        assert sem.count("queued") == 1  # two slots free, and nothing started
        status = cli(app, "status", "queued")
        assert "PAUSED by ops on call" in status, status
        assert running.release()  # the running body ends: still nothing starts
        assert sem.room.head("queued")[0] == 4
        assert "Resumed 'queued'" in cli(app, "resume", "queued")
        assert [w.waiter for w in sem.room.waiters("queued")] == [results[3].id]
        assert [r.get(timeout=60) for r in results] == [0, 1, 2, 3]
    runs = History.load(client, BODIES)
    runs.assert_ok({"queued": 3}, tasks=[r.id for r in results])
    assert runs.values("n")[3] == 3
    assert client.exists(redis_keys("semaphore", "queued").limits) == 0  # nothing left
