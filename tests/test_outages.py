"""A worker and the outages of what it talks to: a semaphore store it cannot reach, a store
whose persistence it reports, and a Redis broker that restarts under it.

Real redis-server processes and real workers; the worker's log is read as a person would.
"""

from __future__ import annotations

import itertools
import logging
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from kombu.exceptions import OperationalError

from celery_semaphore.integration.stats import stats_key
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import prefork_worker_process, wait_for

PASSWORD = "sekrit-3f9a"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Lines(logging.Handler):
    """Every record the library logs, with when it was logged (monotonic seconds)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, logging.LogRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.monotonic(), record))

    def saying(self, text: str) -> list[tuple[float, logging.LogRecord]]:
        return [(t, r) for t, r in self.records if text in r.getMessage()]


@pytest.fixture
def lines() -> Iterator[_Lines]:
    handler = _Lines()
    library = logging.getLogger("celery_semaphore")
    level = library.level
    library.addHandler(handler)
    library.setLevel(logging.INFO)
    yield handler
    library.removeHandler(handler)
    library.setLevel(level)


def test_a_store_out_of_reach_is_one_line_repeated_with_a_backoff_and_runs_wait_for_it(
    redis_server: RedisServer, lines: _Lines
) -> None:
    """Proves: a worker whose ``semaphore_url`` has nothing listening says so in one warning
    line (the URL with its password masked, and what happens to runs), again after 2, 4,
    8 s, ... and never with a traceback; the runs meanwhile are shed with a countdown, as
    documented, and run once the store is up, which a line reports."""
    port = _free_port()
    url = f"redis://csem:{PASSWORD}@127.0.0.1:{port}/0"
    app = make_app(redis_server.url, semaphore_url=url)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        runs = [app.tasks["csem.queued"].delay(n, 0.0) for n in range(2)]
        outage = lambda: [  # noqa: E731
            (t, r) for t, r in lines.saying("unreachable") if r.getMessage().startswith("semaph")
        ]
        assert wait_for(lambda: len(outage()) >= 3, timeout=60), [
            r.getMessage() for _, r in lines.records
        ]
        # Backing off: 2, 4, 8 s... apart; a loaded machine delays a timer tick by a second or
        # so, which a single step may show, but not the spread of the whole series.
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(outage())]
        assert gaps[-1] >= 1.3 * gaps[0], gaps
        first = outage()[0][1].getMessage()
        assert f"redis://csem:**@127.0.0.1:{port}/0 (semaphore_url)" in first, first
        assert "shed with a countdown" in first, first
        assert runs[0].state in ("PENDING", "RETRY")
        acl = ("--user", "csem", "on", f">{PASSWORD}", "~*", "&*", "+@all")
        with RedisServer(port=port, extra_args=acl):
            assert [r.get(timeout=60) for r in runs] == [0, 1]
            assert wait_for(lambda: lines.saying("reachable again"), timeout=30)
    app.close()
    logged = [r for _, r in lines.records]
    assert not [r for r in logged if r.exc_info], [r.getMessage() for r in logged if r.exc_info]
    assert not [r for r in logged if PASSWORD in r.getMessage()]
    assert len(outage()) <= 6, [r.getMessage() for _, r in outage()]


def test_a_store_that_goes_again_during_the_first_checks_is_one_line_not_a_traceback(
    redis_server: RedisServer, lines: _Lines
) -> None:
    """The worker's first checks of a store that answered (counters, server warnings) can
    meet the store gone again; that is the outage the watch reports, in one line. Any other
    failure of them keeps its traceback."""
    from celery_semaphore.errors import SemaphoreBackendError
    from celery_semaphore.integration.store_watch import StoreWatch

    def gone() -> None:
        raise SemaphoreBackendError("Redis failed: ConnectionError: connection refused")

    def broken() -> None:
        raise ValueError("a bug")

    app = make_app(redis_server.url)
    for check in (gone, broken):
        assert StoreWatch(app, False, check).check()
    said = lines.saying("could not check the semaphore store")
    assert [r.exc_info is None for _, r in said] == [True, False]
    assert "connection refused" in said[0][1].getMessage()
    app.close()


@pytest.mark.parametrize(
    ("args", "save", "expected"),
    [
        ((), None, "no persistence (save '', appendonly no): a restart of the store loses every"),
        ((), "3600 1", "RDB snapshots only (save '3600 1', appendonly no): a crash"),
        (("--appendonly", "yes"), None, "append-only file (appendfsync everysec): a crash of"),
        (("--appendonly", "yes", "--appendfsync", "always"), None, "loses no parked run it ack"),
        (("--rename-command", "CONFIG", ""), None, "persistence unknown (the server refuses"),
    ],
)
def test_a_worker_says_at_start_up_what_the_stores_persistence_means_for_parked_runs(
    args: tuple[str, ...], save: str | None, expected: str, lines: _Lines
) -> None:
    with RedisServer(extra_args=args) as store:
        if save is not None:
            # Set live: Redis 6.2 keeps the first of two --save arguments (ours is '').
            with store.client() as admin:
                admin.config_set("save", save)
        app = make_app(store.url)
        with start_worker(app, pool="solo", perform_ping_check=False):
            pass
        app.close()
    said = lines.saying("semaphore store redis://127.0.0.1")
    assert len(said) == 1, [r.getMessage() for _, r in lines.records]
    assert expected in said[0][1].getMessage(), said[0][1].getMessage()
    assert "this host's journal (" in said[0][1].getMessage(), said[0][1].getMessage()


def test_the_client_of_a_store_with_an_acl_user_works(redis_server: RedisServer) -> None:
    """The outage test's store: its ACL user answers the URL's credentials."""
    port = _free_port()
    with RedisServer(
        port=port, extra_args=("--user", "csem", "on", f">{PASSWORD}", "~*", "&*", "+@all")
    ):
        client = redis.Redis.from_url(f"redis://csem:{PASSWORD}@127.0.0.1:{port}/0")
        assert client.ping()
        client.close()


def test_a_worker_survives_restarts_of_its_redis_broker_while_runs_wait_in_countdowns(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    """Proves: a prefork worker whose Redis broker (here also the store and the result
    backend) restarts while shed runs wait in their countdowns keeps running, and runs
    tasks once the broker is back. On Celery 5.7 with kombu 5.7, the worker's main process
    died of kombu's ``AttributeError: 'NoneType' object has no attribute 'hostname'`` as its
    consumer closed the lost connection (the countdown messages it held were to be
    restored through a transport already collected): see docs/explanation/guarantees.md."""
    app = make_app(own_redis.url)
    provider = app.tasks["csem.provider_call"]  # limit 3, on_full="retry": sheds
    log = tmp_path / "worker.log"
    with prefork_worker_process(app, log, concurrency=5) as proc:
        name = _node_of(log)

        def back() -> bool:
            """Whether the worker answers a ping (the test's own connection may meet the
            restart first)."""
            try:
                return bool(app.control.ping(destination=[name], timeout=0.5))
            except (redis.ConnectionError, OperationalError):
                return False

        def sheds() -> int:
            with own_redis.client() as counters:
                return int(counters.hget(stats_key("semaphore", name), "shed") or 0)

        for _ in range(2):
            for n in range(12):
                provider.delay(n, 1.0)
            # Runs shed now wait in their countdowns, held by the worker, for seconds more.
            assert wait_for(lambda: sheds() > 0, timeout=60)
            own_redis.restart()  # empty: what waited in it is lost, as documented
            assert wait_for(lambda: proc.poll() is not None or back(), timeout=60)
            assert proc.poll() is None, log.read_text()[-6000:]
        fresh = [provider.delay(n, 0.05) for n in range(6)]
        assert sorted(r.get(timeout=60)["n"] for r in fresh) == list(range(6))
    assert "'NoneType' object has no attribute" not in log.read_text()
    app.close()


def _node_of(log: Path) -> str:
    """The node name of the worker writing ``log`` (its banner's first line)."""
    found = re.search(r"prefork-[0-9a-f]{8}@\S+", log.read_text())
    assert found, log.read_text()
    return found.group(0)
