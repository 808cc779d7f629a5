"""Weighted slots on a real Redis: a run takes ``weight`` units of its key's limit, the
weights in flight never sum above the limit (judged from the bodies' own records), a
weighted holder's units come and go together, and the waiting room serves a heavy run at
its head before lighter ones behind it."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Semaphore, SemaphoreTask, SemaphoreValidationError, current_slot
from celery_semaphore.core.names import redis_keys
from celery_semaphore.core.process import holder_member
from celery_semaphore.testing import RedisServer
from celery_semaphore.views.inspection import view

from . import history
from .helpers import Published, run_in_threads
from .history import BODIES, History

LIMIT = 8


def test_weights_in_flight_never_sum_above_the_limit(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sem = Semaphore(redis_server.url, limit=LIMIT, lease=10.0)
    recorder = redis.Redis.from_url(redis_server.url)
    lock = threading.Lock()
    seeds = iter(range(100))

    def caller() -> None:
        with lock:
            rng = random.Random(next(seeds))
        for _ in range(15):
            weight = rng.choice([1, 1, 2, 3, 5, 8])
            with sem.hold("gpu", weight=weight, retries=400, retry_delay=0.005) as slot:
                assert slot.weight == weight
                with history.run(recorder, BODIES, "gpu", weight=weight):
                    time.sleep(rng.uniform(0, 0.01))

    run_in_threads(caller, 8)
    report = History.load(client, BODIES).assert_ok({"gpu": LIMIT})
    assert report.runs == 8 * 15
    assert report.peaks["gpu"] >= LIMIT - 2  # the weights really shared the limit
    assert sem.count("gpu") == 0
    recorder.close()


def test_a_weighted_holders_units_come_and_go_together(
    make_semaphore: Any, client: redis.Redis
) -> None:
    sem: Semaphore = make_semaphore(limit=5, lease=1.0)
    heavy = sem.acquire("k", weight=3)
    light = sem.acquire("k", weight=2)
    assert heavy is not None
    assert light is not None
    assert sem.acquire("k") is None  # 5 of 5 units held
    assert (sem.count("k"), sem.available("k")) == (5, 0)
    holders = sem.admin.holders("k")
    assert sorted(h.metadata.get("weight", 1) for h in holders) == [2, 3]
    assert view(client, "k").in_use == 5
    # Renewed together: every unit of a holder moves to its new expiry.
    slots = redis_keys(sem.prefix, "k").slots
    assert heavy.extend(30.0)
    assert light.extend(30.0)
    scores = {m.decode(): s for m, s in client.zrange(slots, 0, -1, withscores=True)}
    # The store knows the holder by its member: the token, then its record.
    member = holder_member("", [m for m in scores if m.startswith(f"{heavy.token}|")])
    units = [member, f"{member}#2", f"{member}#3"]
    assert len({scores[m] for m in units}) == 1
    assert scores[member] > (time.time() + 20) * 1000
    assert sem.count("k") == 5
    # An operator's force release (the weight unknown to it) frees every unit of the holder.
    assert sem.admin.force_release("k", heavy.token)
    assert sem.count("k") == 2
    assert not heavy.release()  # gone: reported, nothing freed twice
    assert sem.count("k") == 2
    assert light.release()
    assert client.keys("semaphore:*") == []
    assert sem.admin.force_release_all("k") == 0


def test_a_heavy_run_at_the_head_of_the_room_is_served_before_lighter_ones(
    redis_server: RedisServer,
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=4, on_handoff=published)
    held = [sem.acquire("k") for _ in range(4)]
    assert sem.room.park("k", "heavy", b"h", weight=3).position == 0  # type: ignore[union-attr]
    for n in range(3):
        sem.room.park("k", f"light-{n}", b"l")
    held[0].release()  # type: ignore[union-attr]
    held[1].release()  # type: ignore[union-attr]
    assert published.waiters == []  # two units free: the heavy head waits, and nobody jumps it
    held[2].release()  # type: ignore[union-attr]
    assert published.waiters == ["heavy"]
    claimed = sem.room.claim("k", "heavy", weight=3)
    assert getattr(claimed, "weight", None) == 3
    assert sem.count("k") == 4
    claimed.release()  # type: ignore[union-attr]
    assert published.waiters == ["heavy", "light-0", "light-1", "light-2"]


@pytest.mark.parametrize("weight", [0, 6, -1, True, "2", 2.0])
def test_bad_weights_are_refused_before_anything_is_written(
    make_semaphore: Any, client: redis.Redis, weight: Any
) -> None:
    sem: Semaphore = make_semaphore(limit=5)
    with pytest.raises(SemaphoreValidationError, match="weight"):
        sem.acquire("k", weight=weight)
    with pytest.raises(SemaphoreValidationError, match="weight"):
        sem.room.park("k", "w", b"", weight=weight)
    assert client.dbsize() == 0


def test_weighted_tasks_share_a_key_by_their_weights(
    redis_server: RedisServer, client: redis.Redis, app: Celery
) -> None:
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="gpus", limit=4, weight=lambda gpus: gpus,
              shared=False, name="w.train")  # fmt: skip
    def train(gpus: int) -> int:
        slot = current_slot()
        assert slot is not None
        with history.run(recorder, BODIES, "gpus", weight=slot.weight):
            time.sleep(0.05)
        return slot.weight

    @app.task(base=SemaphoreTask, semaphore="gpus", limit=4, weight=lambda gpus: gpus,
              shared=False, name="w.bad")  # fmt: skip
    def bad(gpus: int) -> None: ...

    with start_worker(app, pool="threads", concurrency=6, perform_ping_check=False):
        results = [train.delay(g) for g in [4, 1, 2, 1, 3, 1, 2, 4, 1, 1]]
        assert [r.get(timeout=60) for r in results] == [4, 1, 2, 1, 3, 1, 2, 4, 1, 1]
    History.load(client, BODIES).assert_ok({"gpus": 4}, tasks=[r.id for r in results])
    with pytest.raises(SemaphoreValidationError, match=r"'gpus'.*weight must be an int from 1"):
        bad.apply(args=(5,)).get()
    recorder.close()
