"""One provider cap shared by a web app and a Celery worker.

A Starlette app streams "completions" from a stand-in provider, and a Celery worker runs
batch jobs against the same provider. Both are bounded by the key "provider": the handler
with ``@bounded`` on an ``async def``, the task with ``@bounded`` under ``@app.task``. The
provider is a few lines of Lua in Redis that count its calls in flight and answer 429 above
its cap; it knows nothing of celery-semaphore, so its peak is an independent check.

    pip install 'celery-semaphore[asgi]'
    python examples/asgi_shared_cap.py --tasks 30 --requests 30 --limit 4

The script starts Redis (a private server unless REDIS_URL is set) and a threads worker,
sends the tasks, drives the requests through the ASGI app in this process, and prints the
peak in flight against the limit. To serve the app for real instead, run the worker and an
ASGI server against one Redis:

    ASGI_DEMO_REDIS_URL=redis://localhost:6379/0 celery -A asgi_shared_cap worker -P threads
    ASGI_DEMO_REDIS_URL=redis://localhost:6379/0 uvicorn asgi_shared_cap:web
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import redis
from celery import Celery
from redis import asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from celery_semaphore import SemaphoreNotAcquiredError, bounded

HERE = Path(__file__).resolve().parent
REDIS_URL = os.environ.get("ASGI_DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
LIMIT = int(os.environ.get("ASGI_DEMO_LIMIT", "4"))

# The stand-in provider. KEYS: in flight, peak, 429s. ARGV: its cap. Returns 200 or 429.
ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(ARGV[1]) then
  redis.call('DECR', KEYS[1])
  redis.call('INCR', KEYS[3])
  return 429
end
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return 200
"""
PROVIDER = ["asgi-demo:inflight", "asgi-demo:peak", "asgi-demo:429"]
DONE = {"worker": "asgi-demo:done:worker", "web": "asgi-demo:done:web"}

app = Celery("asgi_demo", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    semaphore_url=REDIS_URL,
    semaphore_prefix="asgi-demo",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
_sync = redis.Redis.from_url(REDIS_URL)
_enter = _sync.register_script(ENTER)


@app.task(name="asgi_demo.batch_call")
@bounded("provider", LIMIT)
def batch_call(duration: float) -> int:
    """A batch job's provider call: holds one of the LIMIT slots while it runs."""
    status = int(_enter(keys=PROVIDER, args=[LIMIT]))
    if status == 200:
        time.sleep(duration)
        _sync.decr(PROVIDER[0])
    _sync.incr(DONE["worker"])
    return status


@bounded("provider", LIMIT, app=app, on_full="wait", wait_timeout=60)
async def complete(client: aioredis.Redis, duration: float) -> int:
    """A web request's provider call: the same key, so the same LIMIT slots."""
    status = int(await client.eval(ENTER, len(PROVIDER), *PROVIDER, LIMIT))
    if status == 200:
        await asyncio.sleep(duration)
        await client.decr(PROVIDER[0])
    await client.incr(DONE["web"])
    return status


async def completion(request: Request) -> JSONResponse:
    """``GET /complete?duration=0.2``: one provider call; 503 when no slot came in time."""
    duration = float(request.query_params.get("duration", "0.2"))
    try:
        status = await complete(request.app.state.redis, duration)
    except SemaphoreNotAcquiredError:
        return JSONResponse({"error": "busy"}, status_code=503)
    return JSONResponse({"provider": status}, status_code=status)


@contextlib.asynccontextmanager
async def _lifespan(web: Starlette) -> AsyncIterator[None]:
    web.state.redis = aioredis.Redis.from_url(REDIS_URL)
    yield
    client = web.state.redis
    await (client.aclose() if hasattr(client, "aclose") else client.close())  # 5.0.1 renamed it


web = Starlette(routes=[Route("/complete", completion)], lifespan=_lifespan)


def _start_worker(url: str, limit: int, concurrency: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "ASGI_DEMO_REDIS_URL": url, "ASGI_DEMO_LIMIT": str(limit)}
    command = [sys.executable, "-m", "celery", "-A", "asgi_shared_cap", "worker", "-P", "threads",
               "-c", str(concurrency), "-n", f"asgi-demo@{socket.gethostname()}",
               "--loglevel=WARNING", "--without-gossip", "--without-mingle"]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT)


async def _drive(requests: int, duration: float) -> list[int]:
    transport = httpx.ASGITransport(app=web)
    async with (
        web.router.lifespan_context(web),
        httpx.AsyncClient(transport=transport, base_url="http://demo", timeout=120) as client,
    ):
        calls = [client.get("/complete", params={"duration": duration}) for _ in range(requests)]
        return [r.status_code for r in await asyncio.gather(*calls)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=30, help="batch tasks (default 30)")
    parser.add_argument("--requests", type=int, default=30, help="web requests (default 30)")
    parser.add_argument("--limit", type=int, default=4, help="slots (default 4)")
    parser.add_argument("--duration", type=float, default=0.2, help="seconds per call")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from redis_url import redis_url

    with ExitStack() as stack:
        url = redis_url(stack)
        # The worker and this process must agree: re-run this module's setup for `url`.
        os.environ.update(ASGI_DEMO_REDIS_URL=url, ASGI_DEMO_LIMIT=str(args.limit))
        import asgi_shared_cap as demo

        store = redis.Redis.from_url(url)
        store.delete(*PROVIDER, *DONE.values())
        log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "worker.log"
        worker = _start_worker(url, args.limit, 2 * args.limit, log)
        stack.callback(worker.wait, 30)
        stack.callback(worker.terminate)
        deadline = time.monotonic() + 60
        while not demo.app.control.ping(timeout=0.5):
            if worker.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the worker did not start:\n{log.read_text()}")
        started = time.monotonic()
        results = [demo.batch_call.delay(args.duration) for _ in range(args.tasks)]
        codes = asyncio.run(demo._drive(args.requests, args.duration))
        statuses = [r.get(timeout=120) for r in results]
        took = time.monotonic() - started
        peak, refused = (int(store.get(k) or 0) for k in PROVIDER[1:])
        print(f"worker: {args.tasks} tasks, {statuses.count(200)} served by the provider")
        print(f"web:    {args.requests} requests, {codes.count(200)} answered 200")
        print(f"peak in flight {peak} / limit {args.limit}; {refused} answered 429; {took:.1f}s")
        return 0 if peak <= args.limit and refused == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
