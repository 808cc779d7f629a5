"""Which queue a hand-off goes to: the hand-off queue a worker consumes beside the queue its
run came from (celery_semaphore.integration.waiting_room.queues). The routing rules, read off a
real Celery app's queue declarations; tests/test_room_celery.py sends hand-offs through both
brokers."""

from __future__ import annotations

import pytest
from celery import Celery
from kombu import Exchange, Queue
from kombu.common import Broadcast

from celery_semaphore.integration.waiting_room.queues import (
    SUFFIX,
    consume_handoff_queues,
    handoff_queue,
    handoff_queue_for,
    warm_publisher,
)
from celery_semaphore.testing import RedisServer

URL = "redis://127.0.0.1:1/0"  # never connected to: only declarations are read


@pytest.fixture
def app() -> Celery:
    app = Celery("lanes", broker=URL, set_as_current=False)
    app.conf.task_queues = [
        Queue("plain"),
        Queue("keyed", Exchange("ex", "direct"), routing_key="k"),
        Queue("twin", Exchange("ex", "direct"), routing_key="shared"),
        Queue("twin2", Exchange("ex", "direct"), routing_key="shared"),
        Queue("topical", Exchange("tx", "topic"), routing_key="t.#"),
        Broadcast("everyone"),
        Queue("not-consumed"),
    ]
    app.amqp.queues.select(["plain", "keyed", "twin", "twin2", "topical", "everyone"])
    return app


def test_a_worker_consumes_a_hand_off_queue_beside_each_direct_queue_once(app: Celery) -> None:
    added = consume_handoff_queues(app)
    assert sorted(added) == [f"{q}{SUFFIX}" for q in ("keyed", "plain", "twin", "twin2")]
    consumed = app.amqp.queues.consume_from
    assert f"plain{SUFFIX}" in consumed
    assert f"not-consumed{SUFFIX}" not in consumed  # only the queues this worker consumes
    assert consume_handoff_queues(app) == []  # hand-off queues get none of their own
    # Each just before its own queue: a consumer that serves its queues in a fixed order
    # serves hand-offs first.
    assert list(consumed)[:4] == [f"plain{SUFFIX}", "plain", f"keyed{SUFFIX}", "keyed"]


@pytest.mark.parametrize(
    ("exchange", "routing_key", "expected"),
    [
        ("", "plain", (None, f"plain{SUFFIX}")),  # Celery publishes to a direct queue so
        ("ex", "k", (None, f"keyed{SUFFIX}")),
        # A run a hand-off started: its own queue is the one its hand-off queue serves.
        ("", f"plain{SUFFIX}", ("plain", f"plain{SUFFIX}")),
        ("ex", "shared", (None, None)),  # two queues take this key: which one is unknown
        ("tx", "t.1", (None, None)),  # a topic exchange
        ("everyone", "", (None, None)),  # a broadcast
        ("", "not-consumed", (None, None)),
        (None, None, (None, None)),
    ],
)
def test_a_run_is_handed_off_to_the_hand_off_queue_of_the_queue_it_came_from(
    app: Celery,
    exchange: str | None,
    routing_key: str | None,
    expected: tuple[str | None, str | None],
) -> None:
    consume_handoff_queues(app)
    info = {"exchange": exchange, "routing_key": routing_key}
    assert handoff_queue_for(app, info) == expected


def test_without_hand_off_queues_a_run_keeps_its_own_routing(app: Celery) -> None:
    # The worker consumes none (semaphore_handoff_queues = False, or no queueing task).
    assert handoff_queue_for(app, {"exchange": "", "routing_key": "plain"}) == (None, None)
    assert handoff_queue_for(app, None) == (None, None)


def test_a_process_that_never_consumed_a_hand_off_queue_can_publish_to_it() -> None:
    app = Celery("publisher", broker=URL, set_as_current=False)
    app.conf.task_create_missing_queues = False
    queue = handoff_queue(app, f"plain{SUFFIX}")
    assert (queue.name, queue.routing_key) == (f"plain{SUFFIX}", f"plain{SUFFIX}")
    assert queue.exchange.type == "direct"
    assert f"plain{SUFFIX}" not in app.amqp.queues.consume_from  # published to, not consumed


def test_every_process_declares_a_hand_off_queue_alike() -> None:
    # RabbitMQ refuses a declaration whose arguments differ from the queue's (406).
    def app_of() -> Celery:
        app = Celery("alike", broker=URL, set_as_current=False)
        app.conf.task_queue_max_priority = 10
        app.conf.task_queues = [Queue("reports")]
        return app

    worker, other = app_of(), app_of()
    worker.amqp.queues.select(["reports"])
    consume_handoff_queues(worker)
    consumed = worker.amqp.queues.consume_from[f"reports{SUFFIX}"]
    published = handoff_queue(other, f"reports{SUFFIX}")
    assert consumed.queue_arguments == published.queue_arguments == {"x-max-priority": 10}


def test_a_hand_off_queue_declared_in_task_queues_is_used_as_declared() -> None:
    app = Celery("declared", broker=URL, set_as_current=False)
    quorum = {"x-queue-type": "quorum"}
    app.conf.task_queues = [
        Queue("reports"),
        Queue(f"reports{SUFFIX}", queue_arguments=quorum),
    ]
    app.amqp.queues.select(["reports"])
    assert consume_handoff_queues(app) == [f"reports{SUFFIX}"]
    assert app.amqp.queues.consume_from[f"reports{SUFFIX}"].queue_arguments == quorum
    assert handoff_queue(app, f"reports{SUFFIX}").queue_arguments == quorum


def test_a_pool_process_connects_to_the_broker_as_it_starts() -> None:
    # A private server, so that its clients are only this test's. (Whether the queue was
    # declared cannot be read off the server: kombu remembers Redis bindings per process.)
    with RedisServer() as broker:
        watcher = broker.client()
        app = Celery("warm", broker=broker.url, set_as_current=False)
        consume_handoff_queues(app)
        before = len(watcher.client_list())
        warm_publisher(app)
        assert len(watcher.client_list()) > before  # the producer's connection, kept pooled
        app.close()
        watcher.close()


def test_a_broker_out_of_reach_does_not_stop_a_pool_process() -> None:
    app = Celery("cold", broker=URL, set_as_current=False)
    app.conf.broker_connection_timeout = 0.5
    app.conf.broker_connection_max_retries = 0
    consume_handoff_queues(app)
    warm_publisher(app)  # logs, and leaves the connection to the first publish
