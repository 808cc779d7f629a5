"""The Flower page against a real Flower process, a real worker, real Redis and a real browser.

Flower runs in a subprocess (``tests.flower_helper``) on a free loopback port; the page is
rendered by headless Chromium (``--dump-dom`` runs its scripts). The browser test skips when
``chromium`` is not installed, and the whole module when Flower is not. The live-limit control
is driven over HTTP as a browser's form would drive it: the ``_xsrf`` cookie from a GET of the
page, echoed in the POST.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from http.cookies import SimpleCookie
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import redis
import tornado.web
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import Rate, Semaphore, SemaphoreAdmin, SemaphoreTask, WaitingRoom
from celery_semaphore.testing import RedisServer
from celery_semaphore.views.cli import render
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


# Loopback only, whatever proxy the environment names; a redirect is an answer to look at.
class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_http = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    """Status and body of GET ``url``, with HTTP basic auth when ``auth`` is given."""
    status, body, _ = http(url, auth=auth)
    return status, body


def http(
    url: str,
    fields: dict[str, str] | None = None,
    auth: tuple[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, str, Any]:
    """Status, body and headers of GET ``url``, or of a form POST of ``fields``."""
    data = None if fields is None else urllib.parse.urlencode(fields).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {})
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with _http.open(request, timeout=30) as response:
            return int(response.status), response.read().decode(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers


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


def _serve(
    command: list[str], cwd: Path, env: dict[str, str], log: Path, port: int,
    options: tuple[str, ...], started: list[subprocess.Popen[bytes]],
) -> str:  # fmt: skip
    """Start Flower's ``command`` (logging to ``log``), wait until it answers its health
    check on ``port``, and return its base URL (with its ``--url_prefix``, if any). A port
    another test's process took between ``_free_port`` and Flower's bind is given up for
    another, as often as it happens."""
    with log.open("ab") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=out)
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
    if proc.poll() is not None and "Address already in use" in log.read_text():
        new = _free_port()
        command = [arg.replace(f"--port={port}", f"--port={new}") for arg in command]
        return _serve(command, cwd, env, log, new, options, started)
    assert proc.poll() is None, log.read_text()
    return base


@pytest.fixture
def run_flower(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """``run_flower(*options, semaphore_url=None, unauthenticated_api=False, set_limit=True)``:
    base URL; ``set_limit=False`` sets the app's ``semaphore_flower_set_limit`` to False."""
    started: list[subprocess.Popen[bytes]] = []

    def run(
        *options: str,
        semaphore_url: str | None = None,
        unauthenticated_api: bool = False,
        set_limit: bool = True,
    ) -> str:
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
        if semaphore_url:
            env["CSEM_FLOWER_SEMAPHORE_URL"] = semaphore_url
        if unauthenticated_api:
            env["FLOWER_UNAUTHENTICATED_API"] = "true"
        if not set_limit:
            env["CSEM_FLOWER_SET_LIMIT"] = "0"
        log = tmp_path / f"flower-{port}.log"
        command = [sys.executable, "-m", "tests.flower_helper", redis_server.url,
                   f"--port={port}", "--address=127.0.0.1", *options]  # fmt: skip
        return _serve(command, ROOT, env, log, port, options, started)

    yield run
    for proc in started:
        stop_process(proc)


@pytest.fixture
def celery_flower(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """``celery_flower(*options, config=...)``: a plain ``celery -A ... flower`` started in a
    directory whose ``flowerconfig.py`` holds ``config`` (the documented line by default);
    its base URL. The API is open (``FLOWER_UNAUTHENTICATED_API``) unless options add auth."""
    started: list[subprocess.Popen[bytes]] = []

    def run(*options: str, config: str = "import celery_semaphore.flower  # noqa: F401\n") -> str:
        port = _free_port()
        where = tmp_path / f"flower-{port}"
        where.mkdir()
        (where / "flowerconfig.py").write_text(config)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
        env.update(CSEM_FLOWER_REDIS_URL=redis_server.url, FLOWER_UNAUTHENTICATED_API="true",
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))  # fmt: skip
        celery = Path(sys.executable).with_name("celery")
        log = where / "flower.log"
        command = [str(celery), "-A", "tests.flower_celery_app", "flower", f"--port={port}",
                   "--address=127.0.0.1", *options]  # fmt: skip
        return _serve(command, where, env, log, port, options, started)

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
    status, body = http_get(base + "/api/semaphores")
    assert status == 503
    assert dead.rpartition(":")[2].split("/")[0] in body, body  # the reason names the server


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


# The live-limit control: POST /api/semaphores/limit, as the page's forms send it.

LIMIT_PATH = "/api/semaphores/limit"
FLOWER_CHECKS_ORIGIN = tuple(int(p) for p in version("flower").split(".")[:2]) >= (2, 2)
"""Flower 2.2 refuses cross-site posts by their fetch-metadata headers; 2.1 does not."""


class Session:
    """A browser's view of one Flower: its credentials, and the ``_xsrf`` cookie and form
    token from a GET of the Semaphores page (which sets the cookie)."""

    def __init__(self, base: str, auth: tuple[str, str] | None = None, cookie: str = "") -> None:
        self.base, self.auth, self.cookie = base, auth, cookie
        status, page, headers = self.get("/semaphores")
        assert status == 200, page
        self.page = page
        jar = SimpleCookie()
        for header in headers.get_all("Set-Cookie") or []:
            jar.load(header)
        assert "_xsrf" in jar, "the page set no _xsrf cookie"
        self.xsrf_cookie = jar["_xsrf"].value
        # A page with no form (the control off) has no token to copy; the cookie's is the same.
        found = re.search(r'name="_xsrf" value="([^"]+)"', page)
        self.token = found.group(1).replace("&#124;", "|") if found else self.xsrf_cookie

    def headers(self, xsrf_cookie: bool = True, **extra: str) -> dict[str, str]:
        cookies = [c for c in (self.cookie, xsrf_cookie and f"_xsrf={self.xsrf_cookie}") if c]
        return {"Cookie": "; ".join(cookies), **extra} if cookies else dict(extra)

    def get(self, path: str) -> tuple[int, str, Any]:
        return http(self.base + path, auth=self.auth, headers=self.headers(False))

    def post(self, fields: dict[str, str], token: bool = True, **kwargs: Any) -> tuple[int, str]:
        """POST ``fields`` (plus the form token unless ``token`` is False)."""
        auth = kwargs.pop("auth", self.auth)
        body = {**fields, "_xsrf": self.token} if token else fields
        status, text, _ = http(self.base + LIMIT_PATH, body, auth, self.headers(**kwargs))
        return status, text


def semaphore_keys(client: redis.Redis) -> list[bytes]:
    """Every Redis key under the semaphore prefix: what a refused request must not touch."""
    return sorted(client.scan_iter(match="semaphore:*"))


def test_setting_and_clearing_a_live_limit_through_the_page(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    admin = SemaphoreAdmin(client)
    base = run_flower("--url_prefix=flower", f"--basic_auth={USER}:{PASSWORD}")
    browser = Session(base, (USER, PASSWORD))
    assert 'id="live-limit-key"' in browser.page  # the form for a key the page does not list

    status, body = browser.post({"key": KEY, "limit": "5"})
    assert status == 200, body
    answer = json.loads(body)
    assert (answer["key"], answer["limit"], answer["previous"]) == (KEY, 5, None)
    live = admin.live_limit(KEY)
    assert live is not None
    assert live.limit == 5
    assert live.by == answer["by"]
    assert re.fullmatch(rf"{USER} via Flower from 127\.0\.0\.1 \(.+@{socket.gethostname()} "
                        r"pid \d+\)", live.by), live.by  # fmt: skip
    assert f"(live limit 5, set by {live.by} at " in render(views(client))

    # The page lists the key now, with its live limit, who set it, and a Clear button.
    status, page, _ = browser.get("/semaphores")
    assert status == 200
    text = " ".join(page.split())
    assert f'data-key="{KEY}"' in page
    assert f"Live limit <strong>5</strong>, set by {live.by} at " in text
    assert '<input type="hidden" name="clear" value="1">' in page
    (sem,) = json.loads(browser.get("/api/semaphores")[1])
    assert sem["live_limit"]["limit"] == 5
    assert sem["live_limit"]["by"] == live.by

    # A plain form post (no JavaScript) goes back to the page; the token may be a header.
    status, _, headers = http(base + LIMIT_PATH, {"key": KEY, "limit": "7"}, (USER, PASSWORD),
                              browser.headers(**{"Accept": "text/html", "X-XSRFToken":
                                                 browser.token}))  # fmt: skip
    assert status == 303
    assert headers["Location"] == "/flower/semaphores"
    assert admin.live_limit(KEY).limit == 7  # type: ignore[union-attr]

    status, body = browser.post({"key": KEY, "clear": "1"})
    assert status == 200, body
    assert json.loads(body)["previous"] == 7
    assert admin.live_limit(KEY) is None
    assert "live limit" not in render(views(client))

    odd = " a&b <c> "  # a key is taken as sent: not stripped, not HTML-escaped
    assert browser.post({"key": odd, "limit": "3"})[0] == 200
    assert admin.live_limit(odd).limit == 3  # type: ignore[union-attr]


def test_pausing_and_resuming_a_key_through_the_page(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    admin = SemaphoreAdmin(client)
    admin.set_limit(KEY, 4, by="test")  # a card for the key, whose limit a pause keeps
    base = run_flower(f"--basic_auth={USER}:{PASSWORD}")
    browser = Session(base, (USER, PASSWORD))
    assert '<input type="hidden" name="pause" value="1">' in browser.page

    status, body = browser.post({"key": KEY, "pause": "1"})
    assert status == 200, body
    answer = json.loads(body)
    assert (answer["key"], answer["paused"], answer["was_paused"]) == (KEY, True, False)
    paused = admin.pause_of(KEY)
    assert paused is not None
    assert paused.by == answer["by"]
    status, page, _ = browser.get("/semaphores")
    assert f"Paused by {paused.by} at " in " ".join(page.split())
    assert '<input type="hidden" name="pause" value="0">' in page  # the button resumes now
    (sem,) = json.loads(browser.get("/api/semaphores")[1])
    assert sem["paused"]["by"] == paused.by

    for bad in ({"key": KEY, "pause": "maybe"}, {"key": KEY, "pause": "0", "limit": "2"}):
        assert browser.post(bad)[0] == 400  # nothing changed
    assert admin.pause_of(KEY) is not None
    status, body = browser.post({"key": KEY, "pause": "0"})
    assert status == 200, body
    assert json.loads(body)["was_paused"] is True
    assert admin.pause_of(KEY) is None
    assert admin.live_limit(KEY).limit == 4  # type: ignore[union-attr]


def test_why_a_run_waits_through_the_api(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    sem = Semaphore(client, limit=1)
    held = sem.acquire(KEY, metadata={"task_id": "ahead"})
    assert held is not None
    sem.room.park(KEY, "behind", b"p")
    base = run_flower(f"--basic_auth={USER}:{PASSWORD}")
    status, body, _ = http(f"{base}/api/semaphores/why?task_id=behind", auth=(USER, PASSWORD))
    assert status == 200, body
    (standing,) = json.loads(body)["standings"]
    assert (standing["key"], standing["state"], standing["position"]) == (KEY, "parked", 1)
    assert [h["metadata"]["task_id"] for h in standing["holders"]] == ["ahead"]
    status, body, _ = http(f"{base}/api/semaphores/why?task_id=nobody", auth=(USER, PASSWORD))
    assert (status, json.loads(body)["standings"]) == (200, [])
    assert http(f"{base}/api/semaphores/why", auth=(USER, PASSWORD))[0] == 400
    held.release()


@needs_chromium
def test_the_pages_why_box_says_where_a_run_waits(
    run_flower: Callable[..., str], client: redis.Redis, browse: Callable[..., str]
) -> None:
    """In a real browser: the page's "why" box, asked through ?why=<task id> (what its form
    does too), lists the run's place in line and who holds the slots; an unknown id says
    that no room holds it."""
    sem = Semaphore(client, limit=1)
    held = sem.acquire(KEY, metadata={"task_id": "ahead"})
    assert held is not None
    sem.room.park(KEY, "first", b"p", waited=1.0)  # older by a second, not by a tie's id
    sem.room.park(KEY, "behind", b"p")
    sem.admin.pause(KEY, by="ops")
    base = run_flower(f"--basic_auth={USER}:{PASSWORD}")
    page = browse(with_credentials(base + "/semaphores?why=behind"), "--virtual-time-budget=5000")
    assert 'data-why="behind"' in page, page[-3000:]
    answer = " ".join(re.search(r'id="why-answer".*?</ul>', page, re.S).group(0).split())  # type: ignore[union-attr]
    assert f"{KEY}: parked, 2 of 2 in line, waiting " in answer, answer
    assert "paused by ops; 1 holder(s)." in answer, answer
    page = browse(with_credentials(base + "/semaphores?why=nobody"), "--virtual-time-budget=5000")
    assert 'class="why-none"' in page
    assert "No waiting room holds nobody" in page
    held.release()


def test_the_page_and_the_api_show_a_keys_start_rate(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    sem = Semaphore(client, limit=1)
    held = sem.room.park(KEY, "first", b"p", rates=Rate("2/m", burst=3))
    sem.admin.set_rate(KEY, "1/m", by="ops")
    base = run_flower(f"--basic_auth={USER}:{PASSWORD}")
    browser = Session(base, (USER, PASSWORD))
    text = " ".join(browser.page.split())
    assert 'class="semaphore-rate">Rate requests: 0 of 1 free, one every 60 s' in text, text
    assert "(live 1/m burst 1, set by ops)" in text
    (found,) = json.loads(browser.get("/api/semaphores")[1])
    (rate,) = found["rates"]
    assert (rate["name"], rate["left"], rate["burst"]) == ("requests", 0, 1)
    assert rate["live"]["by"] == "ops"
    held.release()  # type: ignore[union-attr]


def test_raising_the_limit_through_the_page_starts_a_parked_run(
    app: Celery, worker: Any, client: redis.Redis, run_flower: Callable[..., str]
) -> None:
    admin = SemaphoreAdmin(client)
    admin.set_limit(KEY, 1, by="test")  # under the task's own limit of 2
    base = run_flower(f"--basic_auth={USER}:{PASSWORD}")
    browser = Session(base, (USER, PASSWORD))
    first, second = (app.tasks["csem.flower_hold"].delay() for _ in range(2))
    room = WaitingRoom(client)
    assert wait_for(lambda: len(admin.holders(KEY)) == 1 and len(room.waiters(KEY)) == 1,
                    timeout=60)  # fmt: skip
    (parked,) = WaitingRoom(client).waiters(KEY)
    holding = first if holder_of(client, first.id) else second
    waiting = second if holding is first else first
    assert parked.waiter == waiting.id

    status, body = browser.post({"key": KEY, "limit": "2"})
    assert status == 200, body
    # The request's own script call handed the new slot over: no sweep was waited for.
    assert WaitingRoom(client).waiters(KEY) == []
    assert len(admin.holders(KEY)) == 2
    assert wait_for(lambda: holder_of(client, waiting.id), timeout=60), "the run never started"
    client.rpush(RELEASE, "go", "go")
    assert holding.get(timeout=60) == "released"
    assert waiting.get(timeout=60) == "released"


def test_the_control_refuses_a_caller_without_credentials(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    base = run_flower(f"--basic_auth={USER}:{PASSWORD}")
    browser = Session(base, (USER, PASSWORD))
    for auth in (None, (USER, "wrong"), ("intruder", PASSWORD)):
        status, _ = browser.post({"key": KEY, "limit": "5"}, auth=auth)
        assert status == 401, auth
    assert semaphore_keys(client) == []


def test_the_control_refuses_a_post_without_the_xsrf_token(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    base = run_flower(f"--basic_auth={USER}:{PASSWORD}")
    browser = Session(base, (USER, PASSWORD))
    fields = {"key": KEY, "limit": "5"}
    status, body = browser.post(fields, token=False)
    assert (status, body.strip()) == (403, "'_xsrf' argument missing from POST"), body
    # A forged form may guess a field, but cannot read or set the cookie it must match.
    forged = {**fields, "_xsrf": browser.token}
    assert browser.post(forged, token=False, xsrf_cookie=False)[0] == 403
    other = Session(base, (USER, PASSWORD))  # another browser's token
    assert browser.post({**fields, "_xsrf": other.token}, token=False)[0] == 403
    if FLOWER_CHECKS_ORIGIN:  # Flower 2.2's own check, kept for this control
        assert browser.post(fields, **{"Sec-Fetch-Site": "cross-site"})[0] == 403
        assert browser.post(fields, **{"Origin": "http://evil.example"})[0] == 403
    assert semaphore_keys(client) == []
    assert browser.post(fields)[0] == 200


BAD_INPUT: list[tuple[dict[str, str], str]] = [
    ({"key": KEY, "limit": "abc"}, "limit must be an int from 1 to 2147483647, got 'abc'"),
    ({"key": KEY, "limit": "0"}, "limit must be an int from 1 to 2147483647, got 0"),
    ({"key": KEY, "limit": "-3"}, "got -3"),
    ({"key": KEY, "limit": "1.5"}, "got '1.5'"),
    ({"key": KEY, "limit": "2147483648"}, "got 2147483648"),
    ({"key": KEY, "limit": "99999999999999999999999"}, "got '99999999999999999999999'"),
    ({"limit": "5"}, "key must be a non-empty str, got None"),
    ({"key": "", "limit": "5"}, "key must be a non-empty str"),
    ({"key": "k" * 4097, "limit": "5"}, "key must be at most 4096 bytes of UTF-8, got 4097"),
    ({"key": KEY}, "give a limit, or clear=1 (not both)"),
    ({"key": KEY, "limit": "5", "clear": "1"}, "give a limit, or clear=1 (not both)"),
    ({"key": KEY, "clear": "maybe"}, "clear must be true or false, got 'maybe'"),
]
"""Form fields the control refuses, and what its 400 says."""


def test_bad_input_is_a_400_with_the_reason_and_writes_nothing(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    base = run_flower(f"--basic_auth={USER}:{PASSWORD}")
    browser = Session(base, (USER, PASSWORD))
    for fields, message in BAD_INPUT:
        status, body = browser.post(fields)
        assert (status, message in body) == (400, True), (fields, body)
    assert semaphore_keys(client) == []


def test_without_auth_the_control_is_off_unless_the_api_is_open(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    closed = run_flower()
    status, page = http_get(closed + "/semaphores")
    assert status == 200
    assert "Flower runs without authentication" in page
    assert 'name="limit"' not in page
    pair = {"Cookie": "_xsrf=abc"}  # a matching pair, were the token looked at
    status, body, _ = http(closed + LIMIT_PATH, {"key": KEY, "limit": "5", "_xsrf": "abc"},
                           headers=pair)  # fmt: skip
    assert (status, "FLOWER_UNAUTHENTICATED_API" in body) == (401, True)
    assert semaphore_keys(client) == []

    opened = Session(run_flower(unauthenticated_api=True))
    assert 'name="limit"' in opened.page
    assert opened.post({"key": KEY, "limit": "5"}, token=False)[0] == 403  # still a token
    status, body = opened.post({"key": KEY, "limit": "5"})
    assert status == 200, body
    assert json.loads(body)["by"].startswith("anonymous via Flower from 127.0.0.1 (")


def test_read_only_flower_and_the_app_setting_turn_the_control_off(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    for options, set_limit, reason in [
        (("--read_only",), True, "Flower runs with --read_only"),
        ((), False, "app.conf.semaphore_flower_set_limit = False"),
    ]:
        base = run_flower(f"--basic_auth={USER}:{PASSWORD}", *options, set_limit=set_limit)
        browser = Session(base, (USER, PASSWORD))
        assert reason in browser.page
        assert 'name="limit"' not in browser.page
        status, body = browser.post({"key": KEY, "limit": "5"})
        assert status == 403
        assert reason in body
    assert semaphore_keys(client) == []


def test_an_oauth_session_sets_limits_as_its_user(
    run_flower: Callable[..., str], client: redis.Redis
) -> None:
    secret, user = "test-cookie-secret", "alice@example.com"
    base = run_flower(f"--auth={user}", f"--cookie_secret={secret}")
    # The cookie Flower's OAuth login sets, signed with the secret Flower was given.
    signed = tornado.web.create_signed_value(secret, "user", user).decode()
    browser = Session(base, cookie=f"user={signed}")
    status, body = browser.post({"key": KEY, "limit": "3"})
    assert status == 200, body
    live = SemaphoreAdmin(client).live_limit(KEY)
    assert live is not None
    assert live.by.startswith(f"{user} via Flower from 127.0.0.1 (")

    assert browser.post({"key": KEY, "clear": "1"}, token=False)[0] == 403
    # With the token but no session cookie: not logged in.
    stranger = {"Cookie": f"_xsrf={browser.xsrf_cookie}"}
    fields = {"key": KEY, "clear": "1", "_xsrf": browser.token}
    assert http(base + LIMIT_PATH, fields, headers=stranger)[0] == 403
    assert SemaphoreAdmin(client).live_limit(KEY) == live


# Plain `celery flower`, with the one line in flowerconfig.py; and the API's pages.


def test_plain_celery_flower_serves_the_page_with_one_line_of_config(
    celery_flower: Callable[..., str], client: redis.Redis
) -> None:
    admin = SemaphoreAdmin(client)
    admin.set_limit(KEY, 4, by="test")
    base = celery_flower("--url_prefix=flower", f"--basic_auth={USER}:{PASSWORD}")
    assert http_get(base + "/semaphores")[0] == 401  # Flower's own auth guards it
    status, page = http_get(base + "/semaphores", (USER, PASSWORD))
    assert status == 200, page
    assert f'data-key="{KEY}"' in page
    # The navbar link, current on this page, and on Flower's own pages too.
    assert 'href="/flower/semaphores" aria-current="page">Semaphores</a>' in page
    status, workers = http_get(base + "/workers", (USER, PASSWORD))
    assert status == 200
    assert 'data-semaphores-nav href="/flower/semaphores">Semaphores</a>' in workers
    status, body = http_get(base + "/api/semaphores", (USER, PASSWORD))
    assert status == 200, body
    assert [sem["key"] for sem in json.loads(body)] == [KEY]
    # The live-limit control is there too, under the same rules.
    browser = Session(base, (USER, PASSWORD))
    assert browser.post({"key": KEY, "limit": "6"})[0] == 200
    assert admin.live_limit(KEY).limit == 6  # type: ignore[union-attr]


def test_without_the_line_plain_celery_flower_has_no_page(
    celery_flower: Callable[..., str],
) -> None:
    base = celery_flower(config="# Flower alone\n")
    assert http_get(base + "/semaphores")[0] == 404
    assert http_get(base + "/api/semaphores")[0] == 404


def test_the_api_pages_semaphores_and_each_waiting_room(
    celery_flower: Callable[..., str], client: redis.Redis
) -> None:
    room = WaitingRoom(client, limit=1)
    holder = Semaphore(client, limit=1).acquire("busy")
    assert holder is not None
    parked = [f"run-{n:02d}" for n in range(25)]
    for n, waiter in enumerate(parked):
        room.park("busy", waiter, b"payload", arrival=1_000_000 + n)
    admin = SemaphoreAdmin(client)
    for key in ("a-key", "b-key", "c-key"):
        admin.set_limit(key, 2, by="test")
    base = celery_flower()

    status, body, headers = http(base + "/api/semaphores?limit=2")
    assert status == 200, body
    assert headers["X-Total-Count"] == "4"
    assert [sem["key"] for sem in json.loads(body)] == ["a-key", "b-key"]
    status, body, _ = http(base + "/api/semaphores?offset=2&limit=2&waiting=5")
    second = json.loads(body)
    assert [sem["key"] for sem in second] == ["busy", "c-key"]
    busy = second[0]
    assert busy["queued"] == 25  # the total, though the list is cut short
    assert [w["waiter"] for w in busy["waiting"]] == parked[:5]
    status, body, _ = http(base + "/api/semaphores")
    assert [len(sem["waiting"]) for sem in json.loads(body)] == [0, 0, 20, 0]  # default 20

    status, body = http_get(base + "/api/semaphores/waiting?key=busy&offset=20&limit=10")
    assert status == 200, body
    page = json.loads(body)
    assert (page["key"], page["total"], page["offset"], page["limit"]) == ("busy", 25, 20, 10)
    assert [w["waiter"] for w in page["waiting"]] == parked[20:]
    status, body = http_get(base + "/api/semaphores/waiting?key=busy")
    assert [w["waiter"] for w in json.loads(body)["waiting"]] == parked  # default page: 100
    status, body = http_get(base + "/api/semaphores/waiting?key=idle")
    assert json.loads(body) == {"key": "idle", "total": 0, "offset": 0, "limit": 100,
                                "waiting": []}  # fmt: skip

    for query, message in [
        ("/api/semaphores?limit=0", "limit must be an int from 1"),
        ("/api/semaphores?limit=1001", "limit must be at most 1000"),
        ("/api/semaphores?offset=-1", "offset must be an int >= 0"),
        ("/api/semaphores?waiting=abc", "limit must be an int from 1"),
        ("/api/semaphores/waiting", "key must be a non-empty str"),
        ("/api/semaphores/waiting?key=busy&limit=x", "limit must be an int from 1"),
        ("/api/semaphores/waiting?key=busy&offset=1.5", "offset must be an int >= 0"),
    ]:
        status, body = http_get(base + query)
        assert (status, message in body) == (400, True), (query, body)
    holder.release()
