"""The Flower page against a real Flower process, a real worker, real Redis and a real browser.

Flower runs in a subprocess (``tests.flower_helper``) on a free loopback port; the page is
rendered by headless Chromium (``--dump-dom`` runs its scripts). The browser test skips when
``chromium`` is not installed, and the whole module when Flower is not.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import SemaphoreTask
from celery_semaphore.testing import RedisServer
from celery_semaphore.views.inspection import views

from .celery_apps import make_app
from .helpers import stop_process, wait_for

pytest.importorskip(
    "flower", reason="Flower is not installed: pip install 'celery-semaphore[flower]'"
)

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (apt-get install -y chromium): the page is checked in a "
    "real browser",
)
USER, PASSWORD = "viewer", "s3cret"
RELEASE = "test:flower:release"
KEY = "flower-demo"

# Loopback only, whatever proxy the environment names.
_http = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    """Status and body of GET ``url``, with HTTP basic auth when ``auth`` is given."""
    request = urllib.request.Request(url)
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with _http.open(request, timeout=30) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def with_credentials(url: str) -> str:
    return url.replace("http://", f"http://{USER}:{PASSWORD}@", 1)


@pytest.fixture
def app(redis_server: RedisServer) -> Iterator[Celery]:
    """The tests' app, plus ``csem.flower_hold``: holds a slot until RELEASE is pushed."""
    app = make_app(redis_server.url)
    # redis-py's default 5 s socket timeout would cut a long BLPOP short.
    waiter = redis.Redis.from_url(redis_server.url, socket_timeout=130)

    @app.task(base=SemaphoreTask, semaphore=KEY, limit=2, shared=False, name="csem.flower_hold")
    def flower_hold() -> str:
        return "released" if waiter.blpop([RELEASE], timeout=120) else "timed out"

    yield app
    gc.collect()
    waiter.close()
    app.close()


@pytest.fixture
def worker(app: Celery, client: redis.Redis) -> Iterator[Any]:
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False) as worker:
        yield worker
        client.rpush(RELEASE, "go", "go")  # a failed test may leave tasks waiting


@pytest.fixture
def run_flower(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """``run_flower(*options, semaphore_url=None, unauthenticated_api=False)``: base URL."""
    started: list[subprocess.Popen[bytes]] = []

    def run(
        *options: str, semaphore_url: str | None = None, unauthenticated_api: bool = False
    ) -> str:
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
        if semaphore_url:
            env["CSEM_FLOWER_SEMAPHORE_URL"] = semaphore_url
        if unauthenticated_api:
            env["FLOWER_UNAUTHENTICATED_API"] = "true"
        log = tmp_path / f"flower-{port}.log"
        command = [sys.executable, "-m", "tests.flower_helper", redis_server.url,
                   f"--port={port}", "--address=127.0.0.1", *options]  # fmt: skip
        with log.open("wb") as out:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
        started.append(proc)
        prefix = next((o.split("=", 1)[1] for o in options if o.startswith("--url_prefix=")), "")
        base = f"http://127.0.0.1:{port}" + (f"/{prefix.strip('/')}" if prefix else "")

        def answers() -> bool:
            if proc.poll() is not None:
                return True
            try:
                return http_get(f"{base}/healthcheck")[0] == 200
            except OSError:
                return False

        assert wait_for(answers, timeout=60, interval=0.1), log.read_text()
        assert proc.poll() is None, log.read_text()
        return base

    yield run
    for proc in started:
        stop_process(proc)


@pytest.fixture
def browse(tmp_path: Path) -> Callable[..., str]:
    """``browse(url, *chromium_flags)``: the DOM headless Chromium shows after load."""
    profile = tmp_path / "chromium"

    def run(url: str, *flags: str) -> str:
        assert CHROMIUM is not None
        command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                   "--no-first-run", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--no-proxy-server",
                   f"--user-data-dir={profile}", *flags, "--dump-dom", url]  # fmt: skip
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):  # helpers that outlive the browser
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
        return out.decode()

    return run


class HolderRows(HTMLParser):
    """The holder rows of a page: one dict a ``tr.holder`` with its cells' text and link."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []
        self._row: dict[str, Any] | None = None
        self._cell: list[str] | None = None
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "tr" and "holder" in (found.get("class") or "").split():
            self._row = {"task_id": found.get("data-task-id"), "cells": [], "href": None}
            self.rows.append(self._row)
        elif self._row is not None and tag == "td":
            self._cell = []
        elif self._row is not None and tag == "a":
            self._row["href"] = found.get("href")

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row["cells"].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr":
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def holder_of(client: redis.Redis, task_id: str) -> dict[str, Any] | None:
    """The live holder whose task is ``task_id``, as Redis has it, or None."""
    for sem in views(client):
        for holder in sem.holders:
            if holder.metadata.get("task_id") == task_id:
                return dict(holder.metadata)
    return None


def test_basic_auth_guards_the_page_and_the_api(run_flower: Callable[..., str]) -> None:
    base = run_flower("--url_prefix=flower", f"--basic_auth={USER}:{PASSWORD}")
    for path in ("/semaphores", "/api/semaphores"):
        assert http_get(base + path)[0] == 401
        assert http_get(base + path, ("viewer", "wrong"))[0] == 401
    status, page = http_get(base + "/semaphores", (USER, PASSWORD))
    assert status == 200
    assert "No semaphore has a live holder." in page
    assert http_get(base + "/api/semaphores", (USER, PASSWORD)) == (200, "[]")


def test_without_auth_the_api_is_off_as_flowers_is(run_flower: Callable[..., str]) -> None:
    base = run_flower()
    assert http_get(base + "/semaphores")[0] == 200
    status, body = http_get(base + "/api/semaphores")
    assert status == 401
    assert "FLOWER_UNAUTHENTICATED_API" in body


def test_redis_down_gives_503_with_the_reason(run_flower: Callable[..., str]) -> None:
    dead = f"redis://127.0.0.1:{_free_port()}/0"
    base = run_flower(semaphore_url=dead, unauthenticated_api=True)
    status, page = http_get(base + "/semaphores")
    assert status == 503
    assert "Cannot read the semaphores" in page
    assert http_get(base + "/api/semaphores")[0] == 503


@needs_chromium
def test_the_page_lists_a_held_slot_until_its_task_finishes(
    app: Celery,
    worker: Any,
    client: redis.Redis,
    run_flower: Callable[..., str],
    browse: Callable[..., str],
) -> None:
    base = run_flower("--url_prefix=flower", f"--basic_auth={USER}:{PASSWORD}")
    page_url = with_credentials(base + "/semaphores")
    result = app.tasks["csem.flower_hold"].delay()
    assert wait_for(lambda: holder_of(client, result.id), timeout=60)
    meta = holder_of(client, result.id)
    assert meta is not None
    # Celery's in-process test worker gives tasks the bare host as request.hostname (a real
    # `celery worker` gives its node name): either way the page must show what Redis holds.
    assert meta["worker"] in (worker.hostname, worker.hostname.partition("@")[2])

    page = browse(page_url)
    assert [row["task_id"] for row in HolderRows(page).rows] == [result.id]
    row = HolderRows(page).rows[0]
    task, name, node, pid, _held_for, expires_in = row["cells"]
    assert (task, name, node, pid) == (result.id, "csem.flower_hold", meta["worker"],
                                       str(meta["pid"]))  # fmt: skip
    assert row["href"] == f"/flower/task/{result.id}"
    assert expires_in.endswith("s")
    assert f'data-key="{KEY}"' in page
    assert "<strong>1</strong> of 2 in use" in " ".join(page.split())
    assert 'aria-current="page">Semaphores</a>' in page, "the navbar entry is missing"

    # The page re-reads itself: let the browser run its timers, then look again.
    refreshed = browse(page_url, "--virtual-time-budget=8000")
    assert 'data-refreshes="' in refreshed, "the page never refreshed"
    assert [row["task_id"] for row in HolderRows(refreshed).rows] == [result.id]

    status, body = http_get(base + "/api/semaphores", (USER, PASSWORD))
    assert status == 200
    (sem,) = json.loads(body)
    assert (sem["key"], sem["limit"], sem["in_use"]) == (KEY, 2, 1)
    (holder,) = sem["holders"]
    assert holder["metadata"]["task_id"] == result.id
    assert holder["metadata"]["worker"] == meta["worker"]
    assert 0 < holder["expires_in"] <= 60

    client.rpush(RELEASE, "go")
    assert result.get(timeout=60) == "released"
    assert wait_for(lambda: holder_of(client, result.id) is None, timeout=30)
    page = browse(page_url)
    assert result.id not in page
    assert HolderRows(page).rows == []
    assert "No semaphore has a live holder." in page
    assert http_get(base + "/api/semaphores", (USER, PASSWORD)) == (200, "[]")
