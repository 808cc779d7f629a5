"""Hand-off queues: a handed-off run does not wait behind the backlog of its own queue.

A hand-off is a message like any other. Published to the queue its run came from, it would
wait behind every message queued there before it: under a burst, the first slots to free
would stand empty until the workers had fetched and parked the rest of the burst (about a
second for 200 runs on a 2-core machine), and behind a standing backlog of other work for
as long as that backlog lasts.

So every worker of an app with a queueing task also consumes, beside each direct queue it
consumes, a *hand-off queue* named ``<queue>.semaphore-handoffs``; a run that parks records
the hand-off queue of the queue it was delivered from, and its hand-off is published there.
A worker fetches from its queues in turn (kombu's Redis transport moves the queue it just
took a message from to the end of its next BRPOP; RabbitMQ delivers from every queue a
consumer holds as its prefetch allows), so a hand-off is fetched within a message or two of
its publish, whatever waits in the run's own queue.

A run keeps its own routing when its queue cannot be told from its delivery (a topic or
fanout exchange, or two consumed queues bound with one key) or when its worker consumes no
hand-off queue for it (``semaphore_handoff_queues = False``, or an app with no queueing
task).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery import Celery
from kombu.common import maybe_declare
from kombu.entity import Queue

from ...errors import SemaphoreValidationError

logger = logging.getLogger(__name__)

SUFFIX = ".semaphore-handoffs"
"""What a hand-off queue's name adds to the name of the queue it serves."""


def consume_handoff_queues(app: Celery) -> list[str]:
    """Make a worker of ``app`` consume a hand-off queue beside each direct queue it
    consumes. Call it after the worker selected its queues (``-Q``) and before its consumer
    starts: a worker bootstep's constructor.

    Each hand-off queue is made as Celery makes a queue a task names that is not declared
    (``task_create_missing_queue_type`` and its exchange type apply), and declared by the
    consumer when it starts, like any other.

    Returns:
        list[str]: the names of the hand-off queues added.
    """
    queues = app.amqp.queues
    added = []
    for queue in list(queues.consume_from.values()):
        name = queue.name + SUFFIX
        if queue.name.endswith(SUFFIX) or not _direct(queue) or name in queues.consume_from:
            continue
        # A hand-off queue declared in task_queues (say a quorum one) is used as declared.
        queues.select_add(queues[name] if name in queues else queues.new_missing(name))
        added.append(name)
    # Each hand-off queue goes just before its own queue, since the consumer takes its
    # queues in this order: a transport that serves them in a fixed order (kombu's Redis
    # transport with queue_order_strategy "priority") then serves hand-offs first.
    # (By key: Celery may key a queue by its alias, a broadcast queue's for one.)
    consumed = queues.consume_from
    place = {queue.name: n for n, queue in enumerate(consumed.values())}

    def rank(item: tuple[str, Queue]) -> int:  # a hand-off queue added ranks before its own
        key, queue = item
        return place[queue.name.removesuffix(SUFFIX)] - 1 if key in added else place[queue.name]

    ordered = sorted(consumed.items(), key=rank)  # stable: in order otherwise
    consumed.clear()
    consumed.update(ordered)
    return added


def handoff_queue_for(
    app: Celery, delivery_info: Mapping[str, Any] | None
) -> tuple[str | None, str | None]:
    """Where to publish a run delivered as ``delivery_info`` says (a Celery request's
    ``delivery_info``: the exchange and routing key it was published with) again, in a
    worker of ``app``.

    Returns:
        tuple[str | None, str | None]: its own queue, and the hand-off queue of that queue.
        The own queue is None when the delivery's routing stands for it, and the name of
        the queue a hand-off queue serves when the run came through that hand-off queue (a
        run a hand-off started). The hand-off queue is None when the run's queue cannot be
        told or this worker consumes no hand-off queue for it.
    """
    consumed = app.amqp.queues.consume_from
    exchange = (delivery_info or {}).get("exchange") or ""
    routing_key = (delivery_info or {}).get("routing_key")
    found = [q.name for q in consumed.values() if _delivers(q, exchange, routing_key)]
    if len(found) != 1:
        return None, None
    if found[0].endswith(SUFFIX):
        return found[0][: -len(SUFFIX)], found[0]
    name = found[0] + SUFFIX
    return None, name if name in consumed else None


def handoff_queue(app: Celery, name: str) -> Queue:
    """The queue ``name`` as ``app`` would route to it: its declaration in ``task_queues``
    or the worker's own, else one made as the worker makes it (``new_missing``, with the
    app's queue defaults such as ``task_queue_max_priority``, which RabbitMQ requires to
    match on every declaration), even with ``task_create_missing_queues`` off, so that a
    process that never consumed it, such as a worker of other queues, can still publish to
    it."""
    found: Queue | None = app.amqp.queues.get(name)
    if found is None:
        # A Queues of its own applies the app's defaults without adding it to the queues
        # this process consumes.
        found = app.amqp.Queues([app.amqp.queues.new_missing(name)])[name]
    return found


def warm_publisher(app: Celery) -> None:
    """Connect this process's producer to ``app``'s broker and declare the hand-off queues
    this worker consumes, as a prefork pool process starts (``worker_process_init``).

    A process publishes a hand-off the moment its run releases a slot, and the slot stands
    empty until that message is fetched. Without this, a process's first publish would also
    open its broker connection and declare its hand-off queue, which was most of the empty
    time of a burst's first hand-offs (about 60 ms of 90 on a busy 2-core machine). Never
    raises: a broker that cannot be reached now is reached by the first publish instead.
    """
    consumed = app.amqp.queues.consume_from
    try:
        with app.producer_or_acquire() as producer:
            for name in consumed:
                if name.endswith(SUFFIX):
                    maybe_declare(consumed[name], producer.channel)  # type: ignore[no-untyped-call]
    except Exception:
        logger.warning("could not connect to the broker ahead of hand-offs", exc_info=True)


def broadcast_queue_of(app: Celery, delivery_info: Mapping[str, Any] | None) -> str | None:
    """The broadcast (fanout) queue a run delivered as ``delivery_info`` says came through,
    among those a worker of ``app`` consumes (its alias, as ``task_queues`` names it);
    None for any other delivery.

    Every worker consuming a broadcast queue gets its own copy of each message, under one
    task id. A copy that parks or sheds publishes itself through the same fanout exchange
    again, to every worker: parked copies take one another's hand-offs for redeliveries of
    their own and park again, and shed copies multiply, for ever. So a run that would park
    or shed is refused there (see :func:`broadcast_refusal`).
    """
    exchange = (delivery_info or {}).get("exchange")
    for queue in app.amqp.queues.consume_from.values():  # a fanout exchange has a name
        if _fanout(queue) and queue.exchange.name == exchange:
            return str(getattr(queue, "alias", None) or queue.name)
    return None


def broadcast_route_of(app: Celery, task: Any) -> str | None:
    """The broadcast (fanout) queue ``task``'s messages go to when sent with no queue of
    their own (its ``queue`` option, else ``task_routes``), as Celery routes them; None for
    any other route, or one Celery cannot compute (it says so when the task is sent)."""
    options = {"queue": task.queue} if getattr(task, "queue", None) else {}
    try:
        route = app.amqp.router.route(options, task.name, (), {}, task)
    except Exception:
        return None
    queue = route.get("queue")
    if isinstance(queue, Queue) and _fanout(queue):
        return str(getattr(queue, "alias", None) or queue.name)
    return None


def broadcast_refusal(task_name: str, queue: str, on_full: str) -> SemaphoreValidationError:
    """The error of a bounded task that parks or sheds (``on_full``) and meets the broadcast
    queue ``queue``: at a worker's start-up, or at a run delivered through it."""
    return SemaphoreValidationError(
        f"task {task_name!r} (on_full={on_full!r}) meets broadcast queue {queue!r}: every "
        "worker runs its own copy of a broadcast message under one task id, and a copy that "
        "parks or sheds would be published to every worker again, for ever; give the task "
        "on_full='raise', or route it to a direct queue"
    )


def _fanout(queue: Queue) -> bool:
    return queue.exchange is not None and queue.exchange.type == "fanout"


def _direct(queue: Queue) -> bool:
    return queue.exchange is None or queue.exchange.type == "direct"


def _delivers(queue: Queue, exchange: str, routing_key: str | None) -> bool:
    """Whether a message published to ``exchange`` with ``routing_key`` reaches ``queue``
    (the default exchange routes by queue name; a direct exchange by binding key)."""
    if not exchange:
        return queue.name == routing_key
    return (
        _direct(queue)
        and queue.exchange is not None
        and queue.exchange.name == exchange
        and queue.routing_key == routing_key
    )
