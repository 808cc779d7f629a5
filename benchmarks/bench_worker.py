"""A prefork worker of ``backlog_app`` (or another app module here) in a subprocess, for the
benchmarks that drive Celery."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from celery import Celery

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def prefork_worker(
    broker_url: str, store_url: str, concurrency: int, pool: str = "prefork",
    backend_url: str | None = None, queue: str | None = None, name: str = "bench",
    app_module: str = "backlog_app", **env: str,
) -> Iterator[Celery]:  # fmt: skip
    """Start ``celery -A app_module worker -P pool -c concurrency`` on ``broker_url`` (also
    its result backend, unless ``backend_url``) with its semaphores on ``store_url``, wait
    until it answers a ping, and yield a client app on the same broker (its ``worker_pid`` is
    the worker's main process). ``queue`` names the queue the tasks go to (a shared broker,
    RabbitMQ say, may hold other runs' queues); ``name`` is the worker's node name (before
    the host's), the one whose answer is waited for, so that a second worker started beside
    a first is up too when this returns; ``env`` adds BENCH_* variables."""
    backend = backend_url or broker_url
    environ = {**os.environ, **env, "BENCH_BROKER_URL": broker_url,
               "BENCH_SEMAPHORE_URL": store_url, "BENCH_BACKEND_URL": backend,
               "PYTHONPATH": str(HERE)}  # fmt: skip
    if queue:
        environ["BENCH_QUEUE"] = queue
    node = f"{name}@{socket.gethostname()}"
    command = [sys.executable, "-m", "celery", "-A", app_module, "worker", "-P", pool,
               "-c", str(concurrency), "-n", node, "--loglevel=ERROR",
               "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    worker = subprocess.Popen(command, cwd=HERE, env=environ, stdout=subprocess.DEVNULL)
    app = Celery("bench-client", broker=broker_url, backend=backend, set_as_current=False)
    if queue:
        app.conf.task_default_queue = queue
    app.worker_pid = worker.pid  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + 120
        while not app.control.ping(destination=[node], timeout=0.5):
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError("the worker did not start")
        yield app
    finally:
        app.close()
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
