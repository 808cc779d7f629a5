"""Messages held back with a countdown or an ETA against a Redis broker's visibility timeout:
a message held longer than that is restored to its queue and delivered again, so what the
product publishes must stay under it, or say at start-up that it may not. Real redis-server
(broker and store), in-process workers whose broker restores unacked messages every second.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import redis
from celery.contrib.testing.worker import start_worker

from celery_semaphore import BackOff, SemaphoreTask
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import queued, unacked_task_ids, wait_for

VISIBILITY = 2.0
"""The broker's visibility timeout in these tests, seconds (kombu restores a message held
longer, looking every second)."""
RESTORING = {"visibility_timeout": VISIBILITY, "unacked_restore_interval": 1,
             "unacked_restore_throttle": 1}  # fmt: skip


def _store_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


def test_a_cool_down_longer_than_the_visibility_timeout_is_shed_in_pieces_and_runs_once(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    """Proves: with ``on_full="retry"``, a back-off whose cool-down (6 s) is longer than the
    broker's visibility timeout (2 s) does not shed the run with the whole cool-down as its
    countdown (the held message would be restored and run twice): each countdown is at most
    ``shed_max_countdown`` (1 s), the run comes back still cooling and is shed again for the
    rest, and its body runs once more, after the cool-down, and only once."""
    log = "guard:starts"
    app = make_app(redis_server.url, broker_transport_options=RESTORING,
                   semaphore_shed_max_countdown=VISIBILITY / 2)  # fmt: skip

    @app.task(base=SemaphoreTask, semaphore="guard-cooling", limit=2, on_full="retry",
              bind=True, max_retries=0, shed_max_retries=2, shared=False,
              name="guard.cooling")  # fmt: skip
    def cooling(self: Any) -> int:
        client.rpush(log, _store_now(client))
        if client.set("guard:backed-off", 1, nx=True):
            raise BackOff(retry_after=6)
        return int((self.request.headers or {}).get("semaphore_sheds") or 0)

    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            # Its one shed for the back-off: the pieces of the cool-down spend no budget.
            assert cooling.delay().get(timeout=60) == 1
            # A copy restored from the broker would start within a visibility timeout and
            # the restorer's second; nothing is left in the broker either way.
            time.sleep(VISIBILITY + 2)
            assert wait_for(lambda: queued(client) == 0 and not unacked_task_ids(client))
    finally:
        app.close()
    starts = [float(at) for at in client.lrange(log, 0, -1)]
    assert len(starts) == 2, starts  # the run that backed off, and its one run after it
    assert starts[1] - starts[0] >= 6 - 0.1, starts


@pytest.mark.parametrize(("rate", "warned"), [("1/s", True), ("10/s", False)])
def test_a_rate_whose_hand_offs_can_outwait_the_visibility_timeout_is_named_at_start(
    rate: str, warned: bool, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Proves: a worker whose task has a start rate under which a hand-off's ETA can lie
    further ahead than half the Redis broker's visibility timeout (limit 5 at 1/s: 4 s,
    against 1 s) says so at start-up, naming the task, the rate and the timeout; at 10/s
    (0.4 s) it says nothing."""
    app = make_app(redis_server.url, broker_transport_options=RESTORING)

    @app.task(base=SemaphoreTask, semaphore="guard-rated", limit=5, rate=rate, shared=False,
              name="guard.rated")  # fmt: skip
    def rated() -> None:
        return None

    try:
        with (
            caplog.at_level(logging.WARNING, logger="celery_semaphore"),
            start_worker(app, pool="threads", concurrency=1, perform_ping_check=False),
        ):
            pass
    finally:
        app.close()
    lines = [r.getMessage() for r in caplog.records if "visibility_timeout" in r.getMessage()]
    if not warned:
        assert lines == []
        return
    assert len(lines) == 1, lines
    assert "'guard.rated'" in lines[0]
    assert "1/s" in lines[0]
    assert f"{VISIBILITY:g}s" in lines[0]
