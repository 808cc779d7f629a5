"""In-process workers started one after another in one process each run their shed runs."""

from __future__ import annotations

import gc

from celery.contrib.testing.worker import start_worker

from celery_semaphore import Semaphore
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import wait_for


def test_a_later_in_process_worker_runs_shed_runs(redis_server: RedisServer) -> None:
    # With kombu < 5.6.1 (every Celery 5.5) and without conftest's worker_init hook, the second
    # worker runs on the first one's closed event loop, which fires only the first worker's
    # timer: the shed run (a message with a countdown) is received and never run.
    app = make_app(redis_server.url)
    task = app.tasks["csem.provider_call"]
    sem = Semaphore(redis_server.url, limit=3)
    try:
        for round_ in range(2):
            with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
                held = [sem.acquire("provider") for _ in range(3)]  # every slot taken
                result = task.delay(round_, 0.0)
                assert wait_for(lambda r=result: r.state == "RETRY", timeout=10)  # shed
                for slot in held:
                    assert slot is not None
                    slot.release()
                reply = result.get(timeout=20)
                assert reply["n"] == round_, reply
                assert reply["sheds"] >= 1, reply
    finally:
        sem.client.close()
        gc.collect()
        app.close()
