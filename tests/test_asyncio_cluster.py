"""The asyncio semaphore on a real Redis Cluster: its slots are the sync semaphore's, and one
renewal task renews keys on every primary, one script call per hash slot."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from redis import asyncio as aioredis

from celery_semaphore import Semaphore, SemaphoreLeaseLostError, SemaphoreValidationError
from celery_semaphore.asyncio import AsyncSemaphore, AsyncSlot, async_client_like
from celery_semaphore.core.clients import client_from_url

from .servers import ClusterServers
from .test_asyncio import close, run

KEYS = ["openai", "tenant:acme", "{braces}", "a}b{c", "ünïcødé ✓", "k" * 300, "x}"]


@pytest.fixture
def empty(cluster: ClusterServers) -> ClusterServers:
    admin = cluster.client()
    admin.flushall()  # every primary
    admin.close()
    return cluster


def test_cluster_url_makes_a_cluster_client_and_shares_slots_with_sync(
    empty: ClusterServers,
) -> None:
    sync = Semaphore(empty.url, limit=20)

    async def main() -> None:
        async with AsyncSemaphore(empty.url, limit=20) as sem:
            assert isinstance(sem.client, aioredis.RedisCluster)
            results = await asyncio.gather(*(sem.acquire("openai") for _ in range(25)))
            assert results.count(None) == 5
            assert await asyncio.to_thread(sync.count, "openai") == 20
            with pytest.raises(SemaphoreValidationError):
                await sem.acquire("}lead")  # its two keys would land in different slots
            for slot in results:
                if slot is not None:
                    assert await slot.release() is True

    run(main)
    assert sync.count("openai") == 0


def test_one_renewal_task_keeps_keys_on_every_primary_and_loses_only_the_freed_one(
    empty: ClusterServers,
) -> None:
    sync = Semaphore(empty.url, limit=2)

    async def main() -> None:
        twin = async_client_like(client_from_url(empty.url))  # the decorator's way in
        sem = AsyncSemaphore(twin, limit=2, lease=1.0)
        async with contextlib.AsyncExitStack() as stack:
            held: dict[str, AsyncSlot] = {}
            for key in KEYS:
                held[key] = await stack.enter_async_context(sem.hold(key, heartbeat=0.25))
            await asyncio.sleep(2.5)  # the fault-free part: more than two leases
            assert not any(slot.lost.is_set() for slot in held.values())
            assert await asyncio.to_thread(sync.force_release_all, "tenant:acme") == 1
            await asyncio.wait_for(held["tenant:acme"].lost.wait(), 10)
            await asyncio.sleep(0.6)  # two more ticks: nobody else may be reported lost
            assert [k for k, s in held.items() if s.lost.is_set()] == ["tenant:acme"]
            with contextlib.suppress(SemaphoreLeaseLostError):
                await stack.aclose()
        for key in KEYS:
            assert await sem.count(key) == 0
        await close(twin)

    run(main)
