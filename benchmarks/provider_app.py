"""The Celery app that bench_provider.py drives: one HTTP call to a provider that answers 429
above its own concurrency limit, bounded with a fixed limit or an adaptive one.

Environment: BENCH_BROKER_URL (broker), BENCH_BACKEND_URL (results), BENCH_SEMAPHORE_URL (the
semaphore's store), BENCH_PROVIDER_URL (the simulator), BENCH_LIMIT (the fixed limit),
BENCH_ADAPTIVE_INITIAL and BENCH_ADAPTIVE_MAX (the adaptive limit). Nothing is measured here:
the provider records every request itself.
"""

from __future__ import annotations

import os

import httpx
from celery import Celery, Task

from celery_semaphore import SemaphoreTask

BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
STORE = os.environ.get("BENCH_SEMAPHORE_URL", BROKER)
PROVIDER = os.environ.get("BENCH_PROVIDER_URL", "http://127.0.0.1:8000/")
LIMIT = int(os.environ.get("BENCH_LIMIT", "6"))

app = Celery("provider_bench", broker=BROKER, backend=os.environ.get("BENCH_BACKEND_URL", BROKER))
app.conf.update(semaphore_url=STORE, worker_prefetch_multiplier=1, task_acks_late=False)


class ProviderBusy(Exception):
    """The provider answered 429; ``retry_after`` is its Retry-After header, in seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(retry_after)
        self.retry_after = retry_after


_client: httpx.Client | None = None
_client_pid = 0


def call_provider(n: int) -> None:
    """One request to the provider; raises :class:`ProviderBusy` on a 429. Each pool process
    keeps one connection open (made after the fork)."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        _client, _client_pid = httpx.Client(timeout=60.0), os.getpid()
    response = _client.get(PROVIDER, params={"n": n})
    if response.status_code == 429:
        raise ProviderBusy(float(response.headers.get("Retry-After", "1")))
    response.raise_for_status()


# max_retries=None on the task: retry()'s own max_retries=None means "the task's default"
# (3), which would fail runs the provider turned away four times.
@app.task(base=SemaphoreTask, semaphore="provider", limit=LIMIT, bind=True, max_retries=None,
          name="provider_fixed")  # fmt: skip
def fixed(self: Task, n: int) -> int:
    """A fixed limit (BENCH_LIMIT) and today's answer to a 429: this run retries itself after
    the provider's Retry-After, as often as it takes."""
    try:
        call_provider(n)
    except ProviderBusy as busy:
        raise self.retry(countdown=busy.retry_after) from busy
    return n


try:  # issue 35, being built: the harness skips the adaptive setup until this imports
    from celery_semaphore import Adaptive, BackOff  # noqa: F401
except ImportError:
    Adaptive = None

if Adaptive is not None:
    _adaptive = Adaptive(
        initial=int(os.environ.get("BENCH_ADAPTIVE_INITIAL", "10")),
        max=int(os.environ.get("BENCH_ADAPTIVE_MAX", "64")),
    )

    @app.task(base=SemaphoreTask, semaphore="provider", limit=_adaptive,
              back_off_on=(ProviderBusy,), name="provider_adaptive")  # fmt: skip
    def adaptive(n: int) -> int:
        """An adaptive limit: a 429 raises ProviderBusy, which the library treats as a
        fleet-wide back-off (its ``retry_after`` the cool-down) and puts the run back in
        its room."""
        call_provider(n)
        return n
