"""Per-worker counters kept in Redis: how often a worker's tasks were shed, parked or lost a
slot, how many waiting rooms the worker swept (its share of the fleet's sweeps), and how many
hand-offs it fetched found nothing to claim (a reservation taken by a run that parked in
person, another copy claimed first: a slow consumer's sign).

A prefork worker's tasks run in child processes while ``celery inspect stats`` is answered by
the main process, so the counters live in Redis, in one hash per worker node
(``<prefix>:stats:<node name>``, expiring a day after its last update). A count is not
written when it happens: each process adds it up and writes what it has at most once every
:data:`FLUSH_DELAY` seconds, in one round trip, from a timer thread that lives only while
something is left to write. So a burst of parks (the waiting room's common path) costs
no round trip of its own, and a count shows up within about a second. A worker writes what
is left as it stops, and a pool process as it ends (``worker_process_shutdown``); one that
is killed loses what it had not written yet: these are telemetry, never what a slot
depends on.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
from typing import Any

import redis
from celery import Celery

from .settings import app_settings, client_for

logger = logging.getLogger(__name__)

FIELDS = ("shed", "parked", "lease_lost", "dead_released", "swept", "handoffs_missed")
FLUSH_DELAY = 1.0
"""Seconds a process holds its counts before writing them to Redis."""
_TTL = 24 * 3600


def stats_key(prefix: str, worker: str) -> str:
    """The Redis key of ``worker``'s counters."""
    return f"{prefix}:stats:{worker}"


class _Pending:
    """This process's counts not yet written, by app and worker node."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[Celery, dict[str, collections.Counter[str]]] = {}
        self.timer: threading.Timer | None = None

    def add(self, app: Celery, worker: str, field: str, by: int) -> None:
        with self.lock:
            self.counts.setdefault(app, {}).setdefault(worker, collections.Counter())[field] += by
            if self.timer is None:
                self.timer = threading.Timer(FLUSH_DELAY, self.flush)
                self.timer.daemon = True
                self.timer.start()

    def flush(self) -> None:
        """Write every count held, one round trip per app. Never raises."""
        with self.lock:
            counts, self.counts, self.timer = self.counts, {}, None
        for app, workers in counts.items():
            try:
                prefix = app_settings(app).prefix
                pipe = client_for(app).pipeline(transaction=False)
                for worker, fields in workers.items():
                    key = stats_key(prefix, worker)
                    for field, by in fields.items():
                        pipe.hincrby(key, field, by)
                    pipe.expire(key, _TTL)
                pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # A store out of reach is the worker's to report, once (see store_watch);
                # these counts are telemetry, lost with it.
                logger.debug("could not write the semaphore counters: %s", exc)
            except Exception:
                logger.warning("could not write the semaphore counters", exc_info=True)

    def forget(self) -> None:
        """In a forked child: the parent's counts and timer are the parent's to write."""
        self.lock = threading.Lock()
        self.counts, self.timer = {}, None


_PENDING = _Pending()
atexit.register(_PENDING.flush)
os.register_at_fork(after_in_child=_PENDING.forget)


def bump(app: Celery, worker: str | None, field: str, by: int = 1) -> None:
    """Add ``by`` to counter ``field`` of ``worker`` (a node name), written to Redis within
    :data:`FLUSH_DELAY` seconds. Never raises, and makes no round trip."""
    if not worker:
        return
    try:
        _PENDING.add(app, worker, field, by)
    except RuntimeError:  # no thread to be had: the count waits for the next one's timer
        logger.warning("could not schedule the semaphore counters' write", exc_info=True)


def flush() -> None:
    """Write this process's pending counts now (a worker's main process does this before it
    answers ``inspect stats``, so its own counts are never behind). Never raises."""
    _PENDING.flush()


def read(app: Celery, worker: str) -> dict[str, int]:
    """``worker``'s counters; every field of :data:`FIELDS`, 0 when never bumped.

    Raises:
        redis.RedisError: Redis failed.
    """
    raw: dict[Any, Any] = client_for(app).hgetall(stats_key(app_settings(app).prefix, worker))
    values = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
    return {field: values.get(field, 0) for field in FIELDS}


def reset(app: Celery, worker: str) -> None:
    """Zero ``worker``'s counters (a worker does this when it starts)."""
    client_for(app).delete(stats_key(app_settings(app).prefix, worker))
