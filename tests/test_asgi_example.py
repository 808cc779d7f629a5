"""examples/asgi_shared_cap.py, run as a user would: a web app and a threads worker share one
cap, and the stand-in provider never sees more than the limit in flight."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from celery_semaphore.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent


def test_the_web_app_and_the_worker_share_one_cap(redis_server: RedisServer) -> None:
    env = {**os.environ, "REDIS_URL": redis_server.url}
    done = subprocess.run(
        [sys.executable, "examples/asgi_shared_cap.py", "--tasks", "20", "--requests", "20",
         "--limit", "3", "--duration", "0.2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker: 20 tasks, 20 served by the provider" in done.stdout, done.stdout
    assert "web:    20 requests, 20 answered 200" in done.stdout, done.stdout
    found = re.search(r"peak in flight (\d+) / limit 3; 0 answered 429", done.stdout)
    assert found is not None, done.stdout
    assert 1 <= int(found.group(1)) <= 3, done.stdout
