"""Bounded tasks and broadcast (fanout) queues: refused, never a loop.

A message sent to a kombu ``Broadcast`` queue reaches every worker consuming it, each with
its own copy under one task id. A copy that parks or sheds would publish itself through the
fanout exchange again, to every worker: parked copies take one another's hand-offs for
redeliveries, and shed copies multiply. So a task that parks or sheds is refused there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu import Queue
from kombu.common import Broadcast

from celery_semaphore import SemaphoreTask, SemaphoreValidationError
from celery_semaphore.testing import RedisServer

from .celery_apps import make_app
from .helpers import AMQP_URL, rabbitmq_up


@pytest.fixture(params=["redis", "rabbitmq"])
def broadcast_app(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[Celery]:
    """The tests' app, whose workers consume the default queue and a broadcast queue
    ``everyone``; ``b.raising`` is bounded with ``on_full="raise"``, the one safe there.
    Its broker is the tests' Redis, or RabbitMQ, where broadcasts are most used."""
    broker = None
    if request.param == "rabbitmq":
        if not rabbitmq_up():
            pytest.skip("RabbitMQ is not running on 127.0.0.1:5672")
        broker = AMQP_URL
    app = make_app(redis_server.url, broker, task_queues=[Queue("celery"), Broadcast("everyone")])

    @app.task(base=SemaphoreTask, semaphore="bcast", limit=1, on_full="raise", shared=False,
              name="b.raising")  # fmt: skip
    def raising(n: int) -> int:
        return n

    yield app
    app.close()


@pytest.mark.parametrize("on_full", ["queue", "wait", "retry"])
def test_a_worker_will_not_start_with_a_parking_or_shedding_task_routed_to_a_broadcast_queue(
    on_full: str, broadcast_app: Celery
) -> None:
    @broadcast_app.task(base=SemaphoreTask, semaphore="bcast", limit=1, on_full=on_full,
                        shared=False, name="b.routed")  # fmt: skip
    def routed(n: int) -> int:
        return n

    broadcast_app.conf.task_routes = {"b.routed": {"queue": "everyone"}}
    with (
        pytest.raises(SemaphoreValidationError, match=r"task 'b\.routed'.*'everyone'"),
        start_worker(broadcast_app, pool="solo", perform_ping_check=False),
    ):
        pass


def test_a_task_with_a_broadcast_queue_of_its_own_is_refused_too(broadcast_app: Celery) -> None:
    @broadcast_app.task(base=SemaphoreTask, semaphore="bcast", limit=1, shared=False,
                        queue=Broadcast("everyone"), name="b.own_queue")  # fmt: skip
    def own_queue(n: int) -> int:
        return n

    with (
        pytest.raises(SemaphoreValidationError, match=r"task 'b\.own_queue'.*'everyone'"),
        start_worker(broadcast_app, pool="solo", perform_ping_check=False),
    ):
        pass


def test_a_run_sent_to_a_broadcast_queue_fails_instead_of_parking(broadcast_app: Celery) -> None:
    """A parking task routed elsewhere, sent to the broadcast queue by hand: each copy fails
    with the same error (a raise-on-full task runs there as usual). Shown on RabbitMQ: an
    in-process worker on kombu's Redis transport received no broadcast in our runs."""
    if not broadcast_app.conf.broker_url.startswith("amqp"):
        pytest.skip("broadcasts are delivered here through RabbitMQ")
    queued = broadcast_app.tasks["csem.queued"]
    with start_worker(broadcast_app, pool="threads", concurrency=2, perform_ping_check=False):
        raising = broadcast_app.tasks["b.raising"].apply_async((7,), queue="everyone")
        assert raising.get(timeout=30) == 7
        result = queued.apply_async((1, 0.0), queue="everyone")
        with pytest.raises(SemaphoreValidationError, match=r"'everyone'"):
            result.get(timeout=30)
        assert queued.delay(2, 0.0).get(timeout=30) == 2  # its own queue is as before
