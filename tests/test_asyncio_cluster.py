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
            await sem.acquire("tenant:acme")  # on another primary: SCAN visits every one
            assert await sem.admin.scan_keys() == ["openai", "tenant:acme"]
            assert await sem.admin.force_release_all("tenant:acme") == 1
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
            assert await asyncio.to_thread(sync.admin.force_release_all, "tenant:acme") == 1
            await asyncio.wait_for(held["tenant:acme"].lost.wait(), 10)
            await asyncio.sleep(0.6)  # two more ticks: nobody else may be reported lost
            assert [k for k, s in held.items() if s.lost.is_set()] == ["tenant:acme"]
            with contextlib.suppress(SemaphoreLeaseLostError):
                await stack.aclose()
        for key in KEYS:
            assert await sem.count(key) == 0
        await close(twin)

    run(main)


def test_several_keys_must_share_a_hash_tag_and_are_renewed_together(
    empty: ClusterServers,
) -> None:
    sync = Semaphore(empty.url, limit=1)

    async def main() -> None:
        async with AsyncSemaphore(empty.url, limit=1, lease=1.5) as sem:
            with pytest.raises(SemaphoreValidationError, match="different Redis Cluster shards"):
                await sem.acquire_many([("openai", 20), ("tenant:acme", 2)])
            with pytest.raises(SemaphoreValidationError, match="starts with '}'"):
                await sem.acquire_many([("}lead", 1)])
            for node in empty.nodes:  # refused before anything was written, on any node
                with contextlib.closing(node.client()) as plain:
                    assert await asyncio.to_thread(plain.dbsize) == 0
            keys = [("{llm}openai", 20, 2), ("{llm}tenant:acme", 2, 2)]
            async with sem.hold_many(keys, heartbeat=0.2) as group:
                await asyncio.sleep(3.5)  # more than two leases: renewal keeps both
                assert not group.lost.is_set()
                assert await asyncio.to_thread(sync.count, "{llm}openai") == 2
                assert await sem.acquire_many(keys) is None  # the tenant's 2 units are taken
            assert await sem.count("{llm}openai") == 0
            assert await sem.count("{llm}tenant:acme") == 0

    run(main)
    sync.client.close()
