"""The README's main job: the demo, run as a user would, prints no 429s."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from celery_semaphore.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_a_burst_with_no_429s(redis_server: RedisServer) -> None:
    env = {**os.environ, "REDIS_URL": redis_server.url}
    done = subprocess.run(
        [sys.executable, "examples/demo.py", "--tasks", "20", "--limit", "3",
         "--duration", "0.2", "--concurrency", "5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"429s from the provider\s*│\s*0\s", done.stdout), done.stdout
    assert "20 served, 0 refused with 429, 0 failed" in done.stdout
    # Every run that waited in the waiting room was started by a hand-off.
    room = re.search(r"waiting room\s*│\s*(\d+) parked, (\d+) started by a hand-off", done.stdout)
    assert room is not None, done.stdout
    assert room.group(1) == room.group(2), done.stdout
