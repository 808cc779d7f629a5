"""A run that holds several keys, as the signals see it: they keep ``key`` and ``template``
joined with ``+`` and add ``keys`` and ``templates`` apart, on a real Redis."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from celery_semaphore import (
    Semaphore,
    SemaphoreNotAcquiredError,
    bounded,
    signals,
)
from celery_semaphore.testing import RedisServer

MANY = [("provider", 3), ("tenant:{tenant}", 1)]
LABELS = ("provider", "tenant:{tenant}")
JOINED = "provider+tenant:{tenant}"


@pytest.fixture
def sent() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every semaphore signal sent during the test: (name, keyword arguments)."""
    found: list[tuple[str, dict[str, Any]]] = []
    lock = threading.Lock()
    handlers = []
    for name in signals.__all__:
        signal = getattr(signals, name)

        def handler(name: str = name, **kwargs: Any) -> None:
            with lock:
                found.append((name, kwargs))

        signal.connect(handler, weak=False)
        handlers.append((signal, handler))
    yield found
    for signal, handler in handlers:
        signal.disconnect(handler)


def test_signals_name_every_key_apart_and_keep_the_joined_key(
    redis_server: RedisServer, sent: list[tuple[str, dict[str, Any]]]
) -> None:
    @bounded(MANY, redis=redis_server.url)
    def call(tenant: str) -> str:
        return tenant

    @bounded("solo:{tenant}", 1, redis=redis_server.url)
    def solo(tenant: str) -> str:
        return tenant

    assert call("a") == "a"
    assert solo("b") == "b"
    acquired = [kwargs for name, kwargs in sent if name == "semaphore_acquired"]
    released = [kwargs for name, kwargs in sent if name == "semaphore_released"]
    assert len(acquired) == len(released) == 2
    for kwargs in (acquired[0], released[0]):
        assert kwargs["key"] == "provider+tenant:a"
        assert kwargs["template"] == JOINED
        assert kwargs["keys"] == ["provider", "tenant:a"]
        assert kwargs["templates"] == list(LABELS)
        assert kwargs["limit"] == 3  # the first key's, as before
    for kwargs in (acquired[1], released[1]):
        assert (kwargs["key"], kwargs["template"]) == ("solo:b", "solo:{tenant}")
        assert (kwargs["keys"], kwargs["templates"]) == (["solo:b"], ["solo:{tenant}"])
    # A refusal names every key too.
    sem = Semaphore(redis_server.url, limit=1)
    blocker = sem.acquire("tenant:a")
    with pytest.raises(SemaphoreNotAcquiredError):
        call("a")
    [refused] = [kwargs for name, kwargs in sent if name == "semaphore_refused"]
    assert refused["keys"] == ["provider", "tenant:a"]
    assert refused["templates"] == list(LABELS)
    assert blocker is not None
    assert blocker.release()
