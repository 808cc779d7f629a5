"""The demo's Celery app: a bounded task calling a stand-in model provider.

The provider is a few lines of Lua in Redis that count its in-flight calls and answer 429
when a call would exceed its cap, the way a real provider enforces a concurrency limit. It
knows nothing of celery-semaphore, so its counts are an independent check on the library.

Configured from the environment (the demo sets these for the worker it starts):
DEMO_REDIS_URL, DEMO_LIMIT (slots), DEMO_PROVIDER_CAP (the provider's own limit).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_semaphore import SemaphoreTask
from celery_semaphore.signals import semaphore_acquired, semaphore_parked, semaphore_shed

REDIS_URL = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
LIMIT = int(os.environ.get("DEMO_LIMIT", "5"))
PROVIDER_CAP = int(os.environ.get("DEMO_PROVIDER_CAP", str(LIMIT)))

app = Celery("provider_demo", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    semaphore_url=REDIS_URL,
    semaphore_prefix="demo-semaphore",
    # on_full is left at its default, "queue": a run that finds every slot held waits in the
    # key's waiting room, and the release that frees a slot starts the oldest one at once.
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)

_client = redis.Redis.from_url(REDIS_URL)

# KEYS: in-flight counter, peak, 429 counter. ARGV: cap. Returns 200 or 429.
_enter = _client.register_script(
    """
    local n = redis.call('INCR', KEYS[1])
    if n > tonumber(ARGV[1]) then
      redis.call('DECR', KEYS[1])
      redis.call('INCR', KEYS[3])
      return 429
    end
    if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
    return 200
    """
)
PROVIDER_KEYS = ["demo:provider:inflight", "demo:provider:peak", "demo:provider:429"]
PARKED_KEY = "demo:parked"  # runs parked in the waiting room
HANDOFFS_KEY = "demo:handoffs"  # runs started by a release handing them its slot
SHEDS_KEY = "demo:sheds"  # runs re-queued with a countdown (only if Redis was unreachable)
DONE_KEY = "demo:done"
COUNTER_KEYS = [PARKED_KEY, HANDOFFS_KEY, SHEDS_KEY, DONE_KEY]


def call_provider(duration: float) -> int:
    """One call to the stand-in provider: 200 after ``duration`` seconds, or 429 at once."""
    status = int(_enter(keys=PROVIDER_KEYS, args=[PROVIDER_CAP]))
    if status == 200:
        try:
            time.sleep(duration)
        finally:
            _client.decr(PROVIDER_KEYS[0])
    return status


@app.task(base=SemaphoreTask, semaphore="provider", limit=LIMIT, max_retries=0)
def call_model(n: int, duration: float) -> dict[str, Any]:
    """Bounded: at most LIMIT of these run at once across every worker process."""
    status = call_provider(duration)
    _client.incr(DONE_KEY)
    return {"n": n, "status": status}


@app.task
def call_model_unbounded(n: int, duration: float) -> dict[str, Any]:
    """The same call with no semaphore, to show what the provider does without one."""
    status = call_provider(duration)
    _client.incr(DONE_KEY)
    return {"n": n, "status": status}


@semaphore_parked.connect
def _count_parked(**_: Any) -> None:
    _client.incr(PARKED_KEY)


@semaphore_acquired.connect
def _count_handoff(sender: Any = None, **_: Any) -> None:
    # A run started by a hand-off carries the semaphore_handoff header.
    headers = getattr(getattr(sender, "request", None), "headers", None) or {}
    if "semaphore_handoff" in headers:
        _client.incr(HANDOFFS_KEY)


@semaphore_shed.connect
def _count_shed(**_: Any) -> None:
    _client.incr(SHEDS_KEY)
