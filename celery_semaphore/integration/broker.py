"""A worker's Redis broker that restarts while messages wait in the worker: keep the worker.

Shed runs (and Celery's own countdown and ETA tasks) wait out their countdown in the worker
that fetched them, unacknowledged. On Celery 5.7.0 with kombu 5.7.0 (the only kombu that
Celery 5.7 accepts), a broker connection lost at such a moment took the worker's main
process down. The consumer first collects the lost connection (``Connection.collect()``,
which drops the kombu transport's ``client``), then closes it (``Connection.close()``);
closing its default channel again restores the unacknowledged messages
(``QoS.restore_unacked_once``), and kombu's Redis channel, whose pools it has just
disconnected, builds a new one from the transport's ``client``: ``Channel._connparams``
raises ``AttributeError: 'NoneType' object has no attribute 'hostname'``, which is not a
connection error, so neither kombu nor Celery ignores it, and the worker stops with
"Unrecoverable error". Celery 5.4 to 5.6 only collect the connection, and never meet it
(checked with kombu 5.3.4, 5.5.4, 5.6.2 and 5.7.0).

:func:`survive_broker_restarts` makes that call raise a Redis ``ConnectionError`` instead:
the close then goes on as for any broker out of reach, and the consumer reconnects. The
messages it could not restore stay in the broker's ``unacked`` hash, which kombu restores
after the ``visibility_timeout``, as after any connection lost while the broker is down
(a broker restarted without persistence has lost them anyway).
"""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery

from .store import broker_visibility_timeout


def survive_broker_restarts(app: Celery) -> bool:
    """In a worker of ``app`` whose broker is Redis, make kombu's Redis channel raise a
    connection error, not an ``AttributeError``, when asked to connect through a transport
    already closed (see the module docstring). Idempotent; a channel whose transport is open
    is not touched.

    Returns:
        bool: whether the guard is in place (False: the broker is not Redis, or kombu's
        Redis transport has no ``Channel._connparams`` to guard).
    """
    if broker_visibility_timeout(app) is None:
        return False
    from kombu.transport import redis as kombu_redis

    connparams = getattr(kombu_redis.Channel, "_connparams", None)
    if connparams is None:
        return False
    if getattr(connparams, "__semaphore_guard__", False):
        return True

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        transport = getattr(self, "connection", None)
        if transport is None or getattr(transport, "client", None) is None:
            raise redis.ConnectionError("the broker connection was closed; reconnecting")
        return connparams(self, *args, **kwargs)

    guarded.__semaphore_guard__ = True  # type: ignore[attr-defined]
    guarded.__wrapped__ = connparams  # type: ignore[attr-defined]
    kombu_redis.Channel._connparams = guarded  # type: ignore[method-assign]
    return True
