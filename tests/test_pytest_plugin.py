"""Our pytest plugin's fixtures with Celery's: a bounded task run end to end by Celery's
``celery_worker`` against the plugin's private Redis (docs/how-to/testing.md shows the same)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.worker import WorkController

from celery_semaphore import Semaphore, SemaphoreTask, current_slot

from .helpers import wait_for


@pytest.fixture(scope="session")
def celery_config(semaphore_redis_url: str) -> dict[str, Any]:
    """Celery's ``celery_app`` on the plugin's server: broker, results and the semaphore."""
    return {
        "broker_url": semaphore_redis_url,
        "result_backend": semaphore_redis_url,
        "semaphore_url": semaphore_redis_url,
    }


@pytest.fixture
def sem(semaphore_redis_url: str) -> Iterator[Semaphore]:
    """A semaphore on the same server, to look at the slots from outside the task."""
    sem = Semaphore(semaphore_redis_url, limit=1)
    yield sem
    sem.client.close()


def test_a_bounded_task_holds_its_slot_on_the_private_redis(
    celery_app: Celery, celery_worker: WorkController, sem: Semaphore
) -> None:
    @celery_app.task(base=SemaphoreTask, semaphore="plugin:report", limit=1)
    def report() -> list[Any]:
        return [sem.count("plugin:report"), current_slot() is not None]

    celery_worker.reload()  # the worker started before the task was defined
    assert report.delay().get(timeout=30) == [1, True]  # the body ran holding the slot
    # and gave it back (a run in a worker sends its release after it returns)
    assert wait_for(lambda: sem.count("plugin:report") == 0, timeout=10)


def test_semaphore_unbounded_runs_the_body_with_no_slot(
    celery_app: Celery, celery_worker: WorkController, sem: Semaphore, semaphore_unbounded: None
) -> None:
    @celery_app.task(base=SemaphoreTask, semaphore="plugin:busy", limit=1)
    def report() -> list[Any]:
        return [sem.count("plugin:busy"), current_slot() is None]

    celery_worker.reload()
    with sem.hold("plugin:busy"):  # the only slot is taken, and the body runs all the same
        assert report.delay().get(timeout=30) == [1, True]


def test_pytest_loads_the_plugin_by_its_entry_point(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_private_redis(semaphore_redis, semaphore_redis_url):
            assert semaphore_redis_url == semaphore_redis.url
            assert semaphore_redis.client().ping()
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
