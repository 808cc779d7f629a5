"""``celery semaphore why TASK_ID``: where a run stands, with a real worker parking real runs
behind slots the test holds, on a real redis-server."""

from __future__ import annotations

import json

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from click.testing import CliRunner, Result

from celery_semaphore import Semaphore, SemaphoreValidationError
from celery_semaphore.integration.waiting_room.handoffs import publisher_for
from celery_semaphore.views.cli import semaphore as semaphore_cli
from celery_semaphore.views.why import why

from .helpers import wait_for


def _why(app: Celery, *args: str) -> Result:
    ctx = type("Ctx", (), {"app": app})()
    return CliRunner().invoke(semaphore_cli, ["why", *args], obj=ctx)


def test_why_tells_a_parked_runs_place_holders_limit_and_budget(
    app: Celery, client: redis.Redis
) -> None:
    sem = Semaphore(app.conf.semaphore_url, limit=3, on_handoff=publisher_for(app))
    held = [sem.acquire("queued", metadata={"task_id": f"holder-{n}"}) for n in range(3)]
    sem.admin.set_limit("queued", 3, by="ops")
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        first = app.tasks["csem.queued"].delay(1, 0.0)
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 1, timeout=30)
        second = app.tasks["csem.queued_budget"].delay(2)  # queue_timeout=0.5 s
        assert wait_for(lambda: len(sem.room.waiters("queued")) == 2, timeout=30)

        out = _why(app, second.id)
        assert out.exit_code == 0, out.output
        assert f"Task {second.id}:" in out.output
        assert "'queued': parked, 2 of 2 in line" in out.output
        assert "gives up in" in out.output
        assert "limit 3 in force (live limit 3, set by ops at " in out.output
        assert "3 holder(s): task holder-" in out.output

        answer = json.loads(_why(app, first.id, "--json").output)
        (standing,) = answer["standings"]
        assert (standing["key"], standing["state"], standing["position"]) == ("queued", "parked", 1)
        assert standing["gives_up_in"] is None  # no budget
        assert {h["metadata"]["task_id"] for h in standing["holders"]} == {
            "holder-0", "holder-1", "holder-2"}  # fmt: skip
        assert standing["live"]["by"] == "ops"

        held[0].release()  # type: ignore[union-attr]
        assert first.get(timeout=60) == 1
        for slot in held[1:]:
            slot.release()  # type: ignore[union-attr]
        second.get(timeout=60, propagate=False)
    out = _why(app, first.id)
    assert out.exit_code == 1
    assert "in no waiting room and holds no slot (its result backend says SUCCESS)" in out.output


def test_why_finds_a_run_holding_a_slot_and_refuses_a_bad_id(
    redis_server: object, client: redis.Redis
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    sem = Semaphore(url, limit=2)
    slot = sem.acquire("k", metadata={"task_id": "running-1"})
    assert slot is not None
    (standing,) = why(client, "running-1")
    assert (standing.key, standing.state, standing.limit) == ("k", "holding", 2)
    assert why(client, "nobody") == []
    with pytest.raises(SemaphoreValidationError):
        why(client, "")
    slot.release()
    sem.client.close()
