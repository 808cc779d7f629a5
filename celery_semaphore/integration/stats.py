"""Per-worker counters kept in Redis: how often a worker's tasks were shed, parked or lost a
slot.

A prefork worker's tasks run in child processes while ``celery inspect stats`` is answered by
the main process, so the counters live in Redis, in one hash per worker node
(``<prefix>:stats:<node name>``, expiring a day after its last update). They are only
touched on the slow paths (a shed, a park, a lost slot, a dead run's release), never per
acquire.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import Celery

from .settings import app_settings, client_for

logger = logging.getLogger(__name__)

FIELDS = ("shed", "parked", "lease_lost", "dead_released")
_TTL = 24 * 3600


def stats_key(prefix: str, worker: str) -> str:
    """The Redis key of ``worker``'s counters."""
    return f"{prefix}:stats:{worker}"


def bump(app: Celery, worker: str | None, field: str, by: int = 1) -> None:
    """Add ``by`` to counter ``field`` of ``worker`` (a node name). Never raises."""
    if not worker:
        return
    try:
        key = stats_key(app_settings(app).prefix, worker)
        pipe = client_for(app).pipeline(transaction=False)
        pipe.hincrby(key, field, by)
        pipe.expire(key, _TTL)
        pipe.execute()
    except Exception:
        logger.warning("could not count %s for worker %s", field, worker, exc_info=True)


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
    client: redis.Redis = client_for(app)
    client.delete(stats_key(app_settings(app).prefix, worker))
