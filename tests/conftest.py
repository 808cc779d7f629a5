"""Fixtures: real redis-server processes on free loopback ports, owned by the tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import redis
from celery.signals import worker_init
from kombu.asynchronous import set_event_loop

from celery_semaphore import Semaphore
from celery_semaphore.testing import RedisServer


@worker_init.connect
def _own_event_loop_per_worker(**_: object) -> None:
    """Give every in-process worker an event loop of its own.

    A worker's Hub step reuses kombu's process-wide current event loop if one is set, and
    kombu before 5.6.1 (so every Celery 5.5) leaves a closed worker's loop set. A later
    in-process worker then runs on that loop, which fires the *earlier* worker's timer, never
    its own: messages with a countdown or ETA (shed runs, ``self.retry(countdown=...)``) are
    received and never run. kombu 5.6.1 clears the loop in ``Hub.close`` (celery/kombu#2404).
    """
    set_event_loop(None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak-tasks", type=int, default=1000, help="tasks in the soak test")


@pytest.fixture
def soak_tasks(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--soak-tasks"))


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """One server for tests that only need a clean dataset."""
    with RedisServer() as server:
        yield server
        # Celery AsyncResults talk to the backend in __del__: collect them while it is up.
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
