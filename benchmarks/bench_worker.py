"""A prefork worker of ``backlog_app`` in a subprocess, for the benchmarks that drive Celery."""

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
    broker_url: str, store_url: str, concurrency: int, **env: str
) -> Iterator[Celery]:
    """Start ``celery -A backlog_app worker -P prefork -c concurrency`` on ``broker_url``
    (also its result backend) with its semaphores on ``store_url``, wait until it answers a
    ping, and yield a client app on the same broker (its ``worker_pid`` is the worker's main
    process). ``env`` adds BENCH_* variables."""
    environ = {**os.environ, **env, "BENCH_BROKER_URL": broker_url,
               "BENCH_SEMAPHORE_URL": store_url, "PYTHONPATH": str(HERE)}  # fmt: skip
    command = [sys.executable, "-m", "celery", "-A", "backlog_app", "worker", "-P", "prefork",
               "-c", str(concurrency), "-n", f"bench@{socket.gethostname()}", "--loglevel=ERROR",
               "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    worker = subprocess.Popen(command, cwd=HERE, env=environ, stdout=subprocess.DEVNULL)
    app = Celery("bench-client", broker=broker_url, backend=broker_url, set_as_current=False)
    app.worker_pid = worker.pid  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + 120
        while not app.control.ping(timeout=0.5):
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
