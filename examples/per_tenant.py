"""Per-tenant limits: one key per tenant from a template over the task's arguments.

Each tenant may run 2 syncs at once, whatever the number of workers; tenants do not wait for
each other. Runs an in-process worker (threads pool) so it needs nothing but Redis:

    python examples/per_tenant.py          # uses REDIS_URL, or starts a private redis-server
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from contextlib import ExitStack

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from redis_url import redis_url

from celery_semaphore import SemaphoreTask


def make_app(url: str) -> Celery:
    # A sync that finds its tenant's 2 slots held waits in that tenant's waiting room (the
    # default, on_full="queue") and starts the moment one of the 2 ends.
    app = Celery("per_tenant", broker=url, backend=url)
    peaks = redis.Redis.from_url(url)

    @app.task(base=SemaphoreTask, semaphore="tenant:{tenant_id}", limit=2, name="sync_tenant")
    def sync_tenant(tenant_id: str, seconds: float = 0.3) -> str:
        running = peaks.incr(f"running:{tenant_id}")
        peaks.eval(
            "if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then "
            "redis.call('SET', KEYS[1], ARGV[1]) end",
            1,
            f"peak:{tenant_id}",
            running,
        )
        time.sleep(seconds)
        peaks.decr(f"running:{tenant_id}")
        return tenant_id

    return app


def main() -> None:
    with ExitStack() as stack:
        url = redis_url(stack)
        app = make_app(url)
        # Closed before the server stops, so the result backend does not try to reconnect.
        stack.callback(app.close)
        stack.callback(gc.collect)
        client = redis.Redis.from_url(url)
        stack.enter_context(
            start_worker(app, pool="threads", concurrency=8, perform_ping_check=False)
        )
        task = app.tasks["sync_tenant"]
        tenants = ["acme", "globex", "initech"] * 4
        results = [task.delay(t) for t in tenants]
        done = Counter(r.get(timeout=60) for r in results)
        del results  # AsyncResult.__del__ talks to the backend: let it while Redis is up
        for tenant in sorted(done):
            peak = int(client.get(f"peak:{tenant}") or 0)
            print(f"{tenant}: {done[tenant]} syncs, at most {peak} at once (limit 2)")


if __name__ == "__main__":
    main()
