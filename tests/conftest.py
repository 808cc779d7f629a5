"""Fixtures: real redis-server processes on free loopback ports, owned by the tests."""

from __future__ import annotations

import gc
import os
import subprocess
import threading
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_semaphore import Semaphore, metrics
from celery_semaphore.integration.waiting_room import handoffs
from celery_semaphore.testing import RedisServer, find_redis_server

from .celery_apps import MADE, make_app
from .helpers import Published
from .servers import ClusterServers, SentinelServers, ha_capable

# pytester, for the test that pytest finds our plugin. Celery's fixtures (celery_app,
# celery_worker, ...) come from pytest-celery (the test extra), and our plugin
# (celery_semaphore's pytest11 entry point) loads by itself and isolates in-process workers'
# event loops.
pytest_plugins = ("pytester",)


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


HEAVY = ("test_soak.py", "test_room_faults.py", "test_model.py", "test_rate_matrix.py")
"""The heaviest files (many worker processes, servers frozen and killed, timing windows; the
rate matrix's module-wide fleets, which each process would otherwise start again).
With pytest-xdist they run first (the longest chain of work starts at once) and one after
another in one process, never beside each other: see :func:`pytest_xdist_make_scheduler`."""


def _heavy(nodeid: str) -> bool:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in HEAVY


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist's ``load`` distribution (the default with ``-n``), except that the tests
    of :data:`HEAVY` are one unit of work, which one process runs from start to end.

    ``--dist loadgroup`` with an ``xdist_group`` mark would say the same, but pytest 9.2
    ignores the node id suffix through which pytest-xdist 3.8 passes the group on
    (pytest-dev/pytest-xdist#1386): it would quietly spread the group over every process.
    Another ``--dist`` is left alone."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class HeavyInOneProcess(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return "heavy" if _heavy(nodeid) else nodeid

    return HeavyInOneProcess(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the :data:`HEAVY` files first. And a soak bigger than CI's
    outlives the suite's 5-minute timeout: give it time of its own (its loop has deadlines
    of its own, well within it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # collecting in an xdist worker
        items.sort(key=lambda item: not _heavy(item.nodeid))  # stable: in order otherwise
    minutes = float(config.getoption("--soak-minutes"))
    tasks = int(config.getoption("--soak-tasks"))
    if minutes or tasks > 1000:
        seconds = 60 * minutes + 900 if minutes else 900 + 0.5 * tasks
        for item in items:
            if item.get_closest_marker("soak"):
                item.add_marker(pytest.mark.timeout(seconds))


@pytest.fixture
def published() -> Published:
    """Records what the semaphores a test makes with it hand off."""
    return Published()


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
        handoffs.forget_published()
        gc.collect()


def _wait_for_late_writes() -> None:
    """Wait until the package's timer threads in this process have run.

    A worker's counters (``celery_semaphore.integration.stats``) are written by a
    ``threading.Timer`` about a second after a run counts one: a test whose last run lost
    its lease, say, writes ``semaphore:stats:<node>`` to the shared server after it ended.
    The next test must not see that key: those that check the server holds no key (or no
    ``semaphore:*`` key) would fail, depending only on which test ran before them in this
    process (with pytest-xdist, any of them). Once the timers have run, the flush below
    removes what they wrote.
    """
    for thread in threading.enumerate():
        function = getattr(thread, "function", None)
        if isinstance(thread, threading.Timer) and str(
            getattr(function, "__module__", "")
        ).startswith("celery_semaphore."):
            thread.join(timeout=float(thread.interval) + 10)


@pytest.fixture
def redis_server(shared_redis: RedisServer) -> Iterator[RedisServer]:
    """The shared server, flushed before the test (once an earlier test's late writes are
    done: see :func:`_wait_for_late_writes`)."""
    _wait_for_late_writes()
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


@pytest.fixture(autouse=True)
def _results_let_go() -> Iterator[None]:
    """Cut the result subscriptions of the apps a test made once it ends: an AsyncResult's
    ``__del__`` unsubscribes, and for a result whose server the test stopped, Celery's
    Redis backend retries that 20 times a second apart, in whichever thread the garbage
    collector happens to run: a later test's worker thread, stalled past its waits."""
    yield
    for made in list(MADE):
        made.backend.result_consumer._pubsub = None
    MADE.clear()


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
