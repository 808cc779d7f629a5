"""``celery inspect semaphores``: what a worker answers about its slots.

Each worker answers for the slots its own tasks hold (read from Redis, so a pool process's
slots too), the waiting rooms of those keys (how many wait, the oldest wait, the first few in
line) and its counters (:mod:`.stats`). Registered with Celery's remote control when
:mod:`.worker` is imported.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

from celery import Celery
from celery.worker.control import inspect_command
from redis import RedisCluster

from ..core.admin import SemaphoreAdmin, holder_from_reply, scan_keys
from ..core.calls import holders_call, waiting_call
from ..core.live import read_rate_states
from ..core.names import Namespace
from ..core.scripts import Scripts, backend_error, backend_errors
from . import stats
from .settings import app_settings, client_for

REPLY_WITHIN = 0.5
"""Seconds a worker spends reading the store for its remote-control report: Celery's
``inspect`` waits 1 s for replies by default, so a report not read by then goes as it
stands, marked ``truncated`` (10,000 keys take about a tenth of this on a quiet store)."""
PAGE = 500
"""Keys whose holders one pipelined round trip reads."""


def held_by_worker(
    app: Celery, worker: str, within: float = REPLY_WITHIN
) -> tuple[list[dict[str, Any]], bool]:
    """Every live slot whose holder recorded ``worker`` (a Celery node name) as its worker,
    read a page of keys per round trip for at most ``within`` seconds.

    A holder that recorded the bare host part of the node name matches too: tasks run by
    Celery's in-process test worker (``celery.contrib.testing``) see only that in
    ``request.hostname``.

    Returns:
        tuple[list[dict[str, Any]], bool]: one dict a slot (key, task_id, task_name, pid,
        held_for, expires_in in seconds, token), and whether the time ran out before every
        key was read (the slots of the keys left are not listed).

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    deadline = time.monotonic() + within
    client, prefix = client_for(app), app_settings(app).prefix
    names, scripts = Namespace(prefix, isinstance(client, RedisCluster)), Scripts(client)
    mine = {worker, worker.partition("@")[2] or worker}
    keys = scan_keys(client, prefix)
    rows: list[dict[str, Any]] = []
    for start in range(0, len(keys), PAGE):
        if time.monotonic() > deadline:
            return rows, True
        page = keys[start : start + PAGE]
        with backend_errors(prefix):
            replies = scripts.run_many([holders_call(names.keys_of(key)) for key in page])
        for key, reply in zip(page, replies, strict=True):
            if isinstance(reply, Exception):
                raise backend_error(reply, key, None)
            now_ms, found = reply
            for holder in (holder_from_reply(*row, now_ms) for row in found):
                meta = holder.metadata
                if meta.get("worker") in mine:
                    rows.append({
                        "key": key, "task_id": meta.get("task_id"),
                        "task_name": meta.get("task_name"), "pid": meta.get("pid"),
                        "held_for": holder.held_for, "expires_in": holder.expires_in,
                        "token": holder.token,
                    })  # fmt: skip
    return rows, False


def waiting_by_key(app: Celery, keys: Iterable[str], first: int = 3) -> dict[str, Any]:
    """For each of ``keys``: how many runs its room holds, how long the oldest has waited
    (seconds; None when none waits), the task ids of the ``first`` served next, its start
    rates (``rates``: name, units free, seconds until the next falls due) and what the
    provider's answers decided (``feedback``: the adaptive limit, the cool-down, the last
    back-off; None: nothing); two or three round trips a key.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    client, prefix = client_for(app), app_settings(app).prefix
    names, scripts = Namespace(prefix, isinstance(client, RedisCluster)), Scripts(client)
    found, admin = {}, SemaphoreAdmin(client, prefix)
    for key in sorted(set(keys)):
        with backend_errors(key):
            now_ms, total, rows = scripts.run(waiting_call(names.keys_of(key), first - 1))
            rates = read_rate_states(client, names.keys_of(key))
        fed = admin.feedback(key)
        found[key] = {"feedback": None if fed is None else dataclasses.asdict(fed),
                      "queued": total, "first": [waiter for waiter, _ in rows],
                      "oldest_wait": (now_ms - rows[0][1]) / 1000 if rows else None,
                      "rates": [{"name": r.name, "free": r.left, "next_due_in": r.due_in}
                                for r in rates]}  # fmt: skip
    return found


def worker_report(app: Celery, worker: str) -> dict[str, Any]:
    """The slots ``worker``'s tasks hold now, the rooms of their keys (see
    :func:`waiting_by_key`), and its counters.

    Returns:
        dict[str, Any]: ``{"held": [...], "waiting": {...}, "counters": {...},
        "truncated": bool}`` (``truncated``: the store's keys were not all read within
        :data:`REPLY_WITHIN`, so ``held`` lists the slots of those read), or
        ``{"error": "..."}`` when the semaphore store cannot be read (never raises: it
        answers remote control).
    """
    try:
        stats.flush()
        held, truncated = held_by_worker(app, worker)
        waiting = waiting_by_key(app, (row["key"] for row in held))
        return {"held": held, "waiting": waiting, "counters": stats.read(app, worker),
                "truncated": truncated}  # fmt: skip
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def semaphores(state: Any, **_: Any) -> dict[str, Any]:
    """Remote control: this worker's held slots (key, task id and name, pid, times)."""
    return worker_report(state.consumer.app, state.consumer.hostname)


inspect_command(name="semaphores", help="List the semaphore slots this worker's tasks hold.")(
    semaphores
)
