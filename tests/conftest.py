"""Fixtures: real redis-server processes on free loopback ports, owned by the tests."""

from __future__ import annotations

import gc
import subprocess
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_semaphore import Semaphore, metrics
from celery_semaphore.integration import room
from celery_semaphore.testing import RedisServer, find_redis_server, isolate_worker_event_loops

from .celery_apps import make_app
from .servers import ClusterServers, SentinelServers, ha_capable

# Celery 5.5's kombu hands a later in-process worker a stale event loop (see the docstring).
isolate_worker_event_loops()


def pytest_report_header() -> list[str]:
    """The versions a run tested, for the support matrix (docs/reference/support.md)."""
    import celery
    import kombu

    server = find_redis_server()
    version = subprocess.run([server, "--version"], capture_output=True, text=True).stdout
    return [
        f"celery {celery.__version__}, kombu {kombu.__version__}, redis-py {redis.__version__}",
        f"redis-server: {server}: {version.strip()}",
    ]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Unset the result backend of every AsyncResult still alive, before pytest's summary.

    The tests' servers are gone by now. An AsyncResult collected later (one in a reference
    cycle, such as a failed EagerResult and its traceback) would try to cancel its pending
    result against a dead server, and Celery retries that for minutes; without a backend its
    ``__del__`` does nothing.
    """
    from celery.result import AsyncResult

    for found in gc.get_objects():
        if isinstance(found, AsyncResult):
            found.backend = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak-tasks", type=int, default=1000, help="tasks in the soak test")
    parser.addoption(
        "--soak-minutes",
        type=float,
        default=0.0,
        help="keep the soak sending tasks and injecting faults for this long (then drain)",
    )
    parser.addoption("--soak-seed", type=int, default=1234, help="the soak's random seed")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A soak bigger than CI's outlives the suite's 5-minute timeout: give it time of its
    own (its loop has deadlines of its own, well within it)."""
    minutes = float(config.getoption("--soak-minutes"))
    tasks = int(config.getoption("--soak-tasks"))
    if minutes or tasks > 1000:
        seconds = 60 * minutes + 900 if minutes else 900 + 0.5 * tasks
        for item in items:
            if item.get_closest_marker("soak"):
                item.add_marker(pytest.mark.timeout(seconds))


@pytest.fixture
def soak_tasks(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--soak-tasks"))


@pytest.fixture
def soak_minutes(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--soak-minutes"))


@pytest.fixture
def soak_seed(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--soak-seed"))


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """One server for tests that only need a clean dataset."""
    with RedisServer() as server:
        yield server
        # Celery AsyncResults talk to the backend in __del__: collect them while it is up
        # (the hand-off publisher's, whose backends may be gone, are dropped quietly).
        room.forget_published()
        gc.collect()


@pytest.fixture
def redis_server(shared_redis: RedisServer) -> Iterator[RedisServer]:
    """The shared server, flushed before the test."""
    client = shared_redis.client()
    client.flushall()
    client.close()
    return shared_redis


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of the test's own, which it may stop, kill, pause or restart."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis_server.client()
    yield c
    c.close()


@pytest.fixture
def make_semaphore(redis_server: RedisServer) -> Iterator[type[Semaphore]]:
    """``make_semaphore(limit=..., lease=...)`` on the shared server."""
    made: list[Semaphore] = []

    def make(**kwargs: object) -> Semaphore:
        sem = Semaphore(redis_server.url, **kwargs)  # type: ignore[arg-type]
        made.append(sem)
        return sem

    yield make  # type: ignore[misc]
    for sem in made:
        sem.client.close()


@pytest.fixture
def app(redis_server: RedisServer) -> Iterator[Celery]:
    """The tests' Celery app (tests/celery_apps.py) on the shared server."""
    app = make_app(redis_server.url)
    yield app
    # Drop AsyncResults (whose __del__ talks to the backend) while the server still runs.
    gc.collect()
    app.close()


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """A prometheus-client registry of the test's own, fed by ``metrics.install``."""
    registry = CollectorRegistry()
    installed = metrics.install(registry)
    yield registry
    installed.uninstall()


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterServers]:
    reason = ha_capable()
    if reason:
        pytest.skip(f"cannot run a Redis Cluster: {reason}")
    with ClusterServers() as started:
        yield started


@pytest.fixture(scope="module")
def sentinel_set() -> Iterator[SentinelServers]:
    reason = ha_capable()
    if reason:
        pytest.skip(f"cannot run Redis Sentinel: {reason}")
    with SentinelServers() as started:
        yield started
