"""Hand-offs that outlive an outage of the store, in a prefork worker whose pool processes
each run one task (``worker_max_tasks_per_child=1``): a room with a backlog, the store
stopped for longer than a lease and a claim timeout while hand-offs wait in the broker or
are prefetched, then started again, with and without persistence. No body may run twice,
and every run must reach a final state or be named lost in a log line.

The slots live on a server of their own (the broker, the results and the bodies' records on
another), which the test stops and starts on the same port.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from celery.result import AsyncResult

from celery_semaphore.testing import RedisServer

from .celery_apps import SOAK_LIMITS, add_soak_tasks, make_app
from .helpers import prefork_worker_process, wait_for
from .history import BODIES, History

KEY = "soak:provider"
"""``csem.soak_heavy``'s key (limit 6, lease 2 s, claim timeout 2 s, on_full="queue")."""
RUNS = 36
UNITS = 3
"""Each run's weight: two runs at a time, while four pool processes take messages."""
OUTAGE = 6.0
"""Seconds the store is down: past the lease and the claim timeout."""


@pytest.mark.parametrize("persistent", [False, True], ids=["empty", "append-only"])
def test_hand_offs_outlive_a_store_outage_with_one_task_per_child(
    persistent: bool, redis_server: RedisServer, client: redis.Redis, tmp_path: Path
) -> None:
    """Proves: with ``--max-tasks-per-child 1``, a backlog of 36 runs in the waiting room
    (weight 3 of 6: two run at a time), the store stopped for 6 s mid-backlog and started
    again, twice, empty or from its append-only file, every run ends in SUCCESS or is named
    lost in a log line of the worker's (the module's contract), no body runs twice, and no
    start puts the key over its limit (an empty store's slots count until it came back)."""
    args = ("--appendonly", "yes", "--appendfsync", "always") if persistent else ()
    store = RedisServer(extra_args=args).start()
    app = add_soak_tasks(make_app(redis_server.url, semaphore_url=store.url))
    env = {"CSEM_TEST_SEMAPHORE_URL": store.url, "CSEM_TEST_MAX_TASKS_PER_CHILD": "1",
           "CSEM_TEST_SWEEP_INTERVAL": "0.5"}  # fmt: skip
    log = tmp_path / "worker.log"
    wiped: list[tuple[float, float]] = []
    try:
        with prefork_worker_process(app, log, concurrency=4, env=env):
            heavy = app.tasks["csem.soak_heavy"]
            runs = [heavy.delay(n, 0.3, UNITS) for n in range(RUNS)]
            # Two outages, each mid-backlog: most runs wait in the room, and hand-offs are
            # under way (in the broker, or prefetched).
            for ran in (4, 16):
                assert wait_for(lambda n=ran: len(History.load(client, BODIES).completed) >= n, 90)
                store.stop()
                time.sleep(OUTAGE)
                if not persistent:
                    wiped.append((time.monotonic(), time.time()))
                store.start()
            assert wait_for(lambda: all(r.ready() for r in runs), timeout=180), _states(runs)
    finally:
        store.close()
        app.close()
    said_lost = [line for line in log.read_text().splitlines() if "lost" in line]
    failed = {r.id: r.state for r in runs if r.state != "SUCCESS"}
    assert {i: s for i, s in failed.items() if not any(i in line for line in said_lost)} == {}
    History.load(client, BODIES).assert_ok(
        {KEY: SOAK_LIMITS[KEY]}, tasks=[r.id for r in runs if r.state == "SUCCESS"],
        may_lose="the store was down past the lease", wiped=wiped,
    )  # fmt: skip


def _states(runs: list[AsyncResult]) -> dict[str, str]:
    return {r.id: r.state for r in runs if not r.ready()}
