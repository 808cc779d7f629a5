"""Every bad input is a SemaphoreValidationError, raised before anything reaches Redis."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_semaphore import Semaphore, SemaphoreValidationError
from celery_semaphore.testing import RedisServer

BAD_LIMITS = [0, -1, 1.5, True, "5", None, 2**53 + 1]
BAD_LEASES = [0, -1, math.nan, math.inf, -math.inf, 0.0004, 1e14, 10**400, True, "1", None]
BAD_DELAYS = [-0.1, math.nan, math.inf, 1e11, 10**400, True, "0.1", None]
BAD_RETRIES = [-1, 1.5, True, "3", None]
BAD_KEYS = ["", None, 5, b"bytes", "\ud800", "x" * 5000]
BAD_HEARTBEATS = [0, -1, math.nan, math.inf, True, "1", 0.6]  # lease is 1.0 here


@pytest.fixture
def untouched(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """Asserts, after the test, that no script ran and no key was written."""
    client = redis_server.client()
    client.config_resetstat()
    yield client
    stats = client.info("commandstats")
    assert not any(name.startswith(("cmdstat_eval", "cmdstat_script")) for name in stats), stats
    assert client.dbsize() == 0
    client.close()


def raises(fn: Callable[[], Any], needle: str) -> None:
    with pytest.raises(SemaphoreValidationError) as info:
        fn()
    assert needle in str(info.value)


@pytest.mark.parametrize("limit", BAD_LIMITS)
def test_bad_limit(untouched: redis.Redis, redis_server: RedisServer, limit: Any) -> None:
    raises(lambda: Semaphore(redis_server.url, limit=limit), "limit")


@pytest.mark.parametrize("lease", BAD_LEASES)
def test_bad_lease(untouched: redis.Redis, redis_server: RedisServer, lease: Any) -> None:
    raises(lambda: Semaphore(redis_server.url, limit=1, lease=lease), "lease")
    if lease is None:
        return  # None is "the semaphore's lease" everywhere but the constructor
    sem = Semaphore(redis_server.url, limit=1)
    raises(lambda: sem.acquire("k", lease=lease), "lease")
    raises(lambda: sem.hold("k", lease=lease).__enter__(), "lease")
    raises(lambda: sem.run("k", lambda slot: None, lease=lease), "lease")


@pytest.mark.parametrize("delay", BAD_DELAYS)
def test_bad_retry_delay(untouched: redis.Redis, redis_server: RedisServer, delay: Any) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    raises(lambda: sem.acquire("k", retry_delay=delay), "retry_delay")
    raises(lambda: sem.run("k", lambda slot: None, retry_delay=delay), "retry_delay")


@pytest.mark.parametrize("retries", BAD_RETRIES)
def test_bad_retries(untouched: redis.Redis, redis_server: RedisServer, retries: Any) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    raises(lambda: sem.acquire("k", retries=retries), "retries")
    raises(lambda: sem.run("k", lambda slot: None, retries=retries), "retries")


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_key(untouched: redis.Redis, redis_server: RedisServer, key: Any) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    calls = (sem.acquire, sem.count, sem.available, sem.admin.holders, sem.admin.force_release_all)
    for call in calls:
        raises(lambda call=call: call(key), "key")  # type: ignore[misc]
    raises(lambda: sem.run(key, lambda slot: None), "key")


@pytest.mark.parametrize("heartbeat", BAD_HEARTBEATS)
def test_bad_heartbeat(untouched: redis.Redis, redis_server: RedisServer, heartbeat: Any) -> None:
    sem = Semaphore(redis_server.url, limit=1, lease=1.0)
    raises(lambda: sem.run("k", lambda slot: None, heartbeat=heartbeat), "heartbeat")


def test_heartbeat_at_half_the_lease_is_allowed(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=1, lease=1.0)
    assert sem.run("k", lambda slot: "ok", heartbeat=0.5) == "ok"


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b", None])
def test_bad_prefix(untouched: redis.Redis, redis_server: RedisServer, prefix: Any) -> None:
    raises(lambda: Semaphore(redis_server.url, limit=1, prefix=prefix), "prefix")


def _deep(levels: int) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for _ in range(levels):
        nested = {"x": nested}
    return nested


@pytest.mark.parametrize("metadata", [["not", "a", "mapping"], {"x": object()}, _deep(100_000)])
def test_bad_metadata(untouched: redis.Redis, redis_server: RedisServer, metadata: Any) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    raises(lambda: sem.acquire("k", metadata=metadata), "metadata")


def test_bad_callback_and_client(untouched: redis.Redis, redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    raises(lambda: sem.run("k", lambda slot: None, on_renew_error="print"), "on_renew_error")
    raises(lambda: Semaphore(42, limit=1), "redis")  # type: ignore[arg-type]
    raises(lambda: Semaphore(untouched.pipeline(), limit=1), "redis")
    raises(lambda: Semaphore("notaurl", limit=1), "notaurl")
    raises(lambda: Semaphore("redis://127.0.0.1:bad/0", limit=1), "Redis URL")


def test_a_str_subclass_key_names_the_same_redis_key(redis_server: RedisServer) -> None:
    class Odd(str):
        def __format__(self, spec: str) -> str:
            return "something else"

    sem = Semaphore(redis_server.url, limit=1)
    slot = sem.acquire(Odd("k"))
    assert slot is not None
    assert type(slot.key) is str
    assert sem.count("k") == 1
    slot.release()


def test_bad_extend_lease(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    slot = sem.acquire("k")
    assert slot is not None
    for lease in BAD_LEASES[:-1]:
        raises(lambda lease=lease: slot.extend(lease=lease), "lease")  # type: ignore[misc]
    assert slot.release() is True


def test_metadata_cannot_overwrite_host_pid_or_limit(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=2)
    slot = sem.acquire("k", metadata={"pid": "x", "host": "h", "limit": 99, "job": 1})
    assert slot is not None
    [holder] = sem.admin.holders("k")
    assert holder.metadata["pid"] == os.getpid()
    assert holder.metadata["host"] != "h"
    assert holder.metadata["limit"] == 2
    assert holder.metadata["job"] == 1
    slot.release()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/abc", "rediss://127.0.0.1/0x1"])
def test_a_url_whose_path_is_not_a_database_number_is_refused(url: str) -> None:
    """redis-py would quietly use database 0 for such a path."""
    with pytest.raises(SemaphoreValidationError, match="database number"):
        Semaphore(url, limit=1)
    assert (
        Semaphore("redis://127.0.0.1:6379/3", limit=1).client.connection_pool.connection_kwargs[
            "db"
        ]
        == 3
    )
