"""One contract for the sync and the asyncio semaphore: the same public surface, and the same
answers from the same calls against a real server.

Each behaviour test is written once, as a coroutine over a semaphore of either kind:
``settle`` awaits what an asyncio call returns and passes a sync call's answer through, and
``holding`` enters a ``with`` or an ``async with`` block alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from celery_semaphore import (
    Refusal,
    Semaphore,
    SemaphoreAdmin,
    SemaphoreBackendError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from celery_semaphore.asyncio import AsyncSemaphore, AsyncSemaphoreAdmin, AsyncSlot
from celery_semaphore.asyncio.group import AsyncSlotGroup
from celery_semaphore.core.group import SlotGroup
from celery_semaphore.core.replies import Parked
from celery_semaphore.core.slot import Slot
from celery_semaphore.testing import RedisServer

from .helpers import Published

SYNC_ONLY = {
    Semaphore: {"room": "the waiting room parks Celery runs; a coroutine waits in acquire"},
}
"""Public names only one side has, and why (the asyncio how-to says the same). Deprecated
aliases (tests/test_public_api.py) are no part of the contract."""

PAIRS = [(Semaphore, AsyncSemaphore), (SemaphoreAdmin, AsyncSemaphoreAdmin)]


NOWHERE = "redis://127.0.0.1:1/0"
"""Nothing listens here; making either semaphore connects to nothing."""


def _surface(cls: type) -> dict[str, list[str]]:
    """Public methods, properties and attributes of an instance of ``cls``, with the
    parameter names of the methods."""
    if cls in (Semaphore, AsyncSemaphore):
        instance = cls(NOWHERE, limit=1)
    else:
        instance = cls(Semaphore(NOWHERE, limit=1).client if cls is SemaphoreAdmin
                       else AsyncSemaphore(NOWHERE, limit=1).client)  # fmt: skip
    found: dict[str, list[str]] = {name: [] for name in vars(instance) if name[0] != "_"}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or hasattr(member, "__deprecated__"):
            continue
        if callable(member) or isinstance(member, property):
            found[name] = (
                [] if isinstance(member, property) else [*inspect.signature(member).parameters]
            )
    if "close" in found:  # the sync spelling of aclose
        found["aclose"] = found.pop("close")
    return found


HELD_PAIRS = [(Slot, AsyncSlot), (SlotGroup, AsyncSlotGroup)]


def _class_surface(cls: type) -> dict[str, list[str]]:
    """Public methods and properties of ``cls`` with their parameter names (a held slot
    cannot be made without a store, so its class is read)."""
    found: dict[str, list[str]] = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or not (callable(member) or isinstance(member, property)):
            continue
        found[name] = (
            [] if isinstance(member, property) else list(inspect.signature(member).parameters)
        )
    return found


@pytest.mark.parametrize(("sync", "twin"), HELD_PAIRS, ids=lambda cls: cls.__name__)
def test_a_held_slot_and_group_offer_the_same_surface_on_both_sides(sync: type, twin: type) -> None:
    ours, theirs = _class_surface(sync), _class_surface(twin)
    assert set(ours) - set(theirs) == set()
    assert set(theirs) - set(ours) == set()
    for name in set(ours) & set(theirs):
        assert ours[name] == theirs[name], f"{name}: {ours[name]} != {theirs[name]}"


@pytest.mark.parametrize(("sync", "twin"), PAIRS, ids=lambda cls: cls.__name__)
def test_the_sync_and_asyncio_classes_offer_the_same_surface(sync: type, twin: type) -> None:
    ours, theirs = _surface(sync), _surface(twin)
    only_sync = set(ours) - set(theirs) - set(SYNC_ONLY.get(sync, {}))
    only_async = set(theirs) - set(ours)
    assert not only_sync, f"{sync.__name__} only: {sorted(only_sync)}"
    assert not only_async, f"{twin.__name__} only: {sorted(only_async)}"
    for name in set(ours) & set(theirs):
        assert ours[name] == theirs[name], f"{name}: {ours[name]} != {theirs[name]}"


async def settle(value: Any) -> Any:
    """A call's answer: awaited when the call was a coroutine's."""
    return await value if inspect.isawaitable(value) else value


@contextlib.asynccontextmanager
async def holding(block: Any) -> AsyncIterator[Any]:
    """Enter a sync or an asyncio context manager alike."""
    if hasattr(block, "__aenter__"):
        async with block as held:
            yield held
    else:
        with block as held:
            yield held


Scenario = Callable[[Any], Awaitable[None]]


@pytest.fixture(params=["sync", "asyncio"])
def against(request: pytest.FixtureRequest, redis_server: RedisServer) -> Callable[..., None]:
    """Run a scenario against a semaphore of each kind (the sync one's calls block the loop,
    which is what a sync caller does)."""

    def run(scenario: Scenario, **options: Any) -> None:
        async def main() -> None:
            if request.param == "sync":
                await scenario(Semaphore(redis_server.url, **options))
                return
            sem = AsyncSemaphore(redis_server.url, **options)
            try:
                await scenario(sem)
            finally:
                await sem.aclose()

        asyncio.run(main())

    return run


def test_acquire_count_available_and_release(against: Callable[..., None]) -> None:
    async def scenario(sem: Any) -> None:
        first = await settle(sem.acquire("k", metadata={"n": 1}))
        second = await settle(sem.acquire("k", weight=1))
        assert first is not None
        assert second is not None
        assert await settle(sem.acquire("k")) is None
        assert await settle(sem.count("k")) == 2
        assert await settle(sem.available("k")) == 0
        assert await settle(sem.available("k", limit=5)) == 3
        holders = await settle(sem.admin.holders("k"))
        assert sorted(h.token for h in holders) == sorted([first.token, second.token])
        assert await settle(first.release()) is True
        assert await settle(first.release()) is True  # later calls repeat the first answer
        assert await settle(sem.admin.force_release_all("k")) == 1
        assert await settle(second.release()) is False  # taken away before
        assert await settle(sem.count("k")) == 0

    against(scenario, limit=2)


def test_hold_and_hold_many_release_on_exit_and_refuse_when_full(
    against: Callable[..., None],
) -> None:
    async def scenario(sem: Any) -> None:
        async with holding(sem.hold("k", heartbeat=0.2)) as slot:
            assert slot.key == "k"
            with pytest.raises(SemaphoreNotAcquiredError):
                async with holding(sem.hold("k")):
                    pass
        async with holding(sem.hold_many([("a", 1), ("b", 2)])) as group:
            assert group.keys == ["a", "b"]
            assert await settle(sem.count("b")) == 1
            with pytest.raises(SemaphoreNotAcquiredError):
                async with holding(sem.hold_many([("b", 2), ("a", 1)])):
                    pass
        assert [await settle(sem.count(k)) for k in ("k", "a", "b")] == [0, 0, 0]

    against(scenario, limit=1)


def test_hold_waits_for_a_release(against: Callable[..., None]) -> None:
    async def scenario(sem: Any) -> None:
        held = await settle(sem.acquire("k", lease=0.5))
        assert held is not None
        # Nobody releases: the wait ends when the held lease lapses, well within the budget.
        async with holding(sem.hold("k", wait=30.0)) as slot:
            assert slot.token != held.token

    against(scenario, limit=1)


def test_the_admin_sets_reads_and_clears_a_live_limit_and_frees_slots(
    against: Callable[..., None],
) -> None:
    async def scenario(sem: Any) -> None:
        assert await settle(sem.admin.set_limit("k", 2, by="ops")) is None
        live = await settle(sem.admin.live_limit("k"))
        assert (live.limit, live.by) == (2, "ops")
        slots = [await settle(sem.acquire("k")) for _ in range(3)]
        assert slots[2] is None
        assert await settle(sem.admin.force_release("k", slots[0].token)) is True
        assert await settle(sem.admin.force_release("k", slots[0].token)) is False
        assert await settle(sem.admin.force_release_all("k")) == 1
        assert await settle(sem.admin.set_limit("k", None)) == 2
        assert await settle(sem.admin.live_limit("k")) is None

    against(scenario, limit=1)


def _due_in(worker: Semaphore, key: str = "k") -> float:
    """Seconds until ``key``'s room is due for a sweep, by the store's clock."""
    score = worker.client.zscore(worker.room.index.key, key)
    assert score is not None
    seconds, micros = worker.client.time()
    return float(score) / 1000 - (seconds + micros / 1e6)


def test_a_force_release_brings_the_room_s_sweep_on(
    against: Callable[..., None],
    redis_server: RedisServer,
    published: Published,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A Celery worker's room parks the runs; the admin of either kind frees the slots.
    worker = Semaphore(redis_server.url, limit=1)

    async def scenario(sem: Any) -> None:
        holder = await settle(sem.acquire("k", lease=3600.0))
        assert isinstance(worker.room.park("k", "w", b"p", room_ttl=400.0), Parked)
        due = worker.room.index.due(interval=0.2, count=100, ttl=3600.0)
        assert worker.room.sweep_many(due.keys, taken_ms=due.taken_ms) == 0
        assert _due_in(worker) > 50  # a still room: swept a quarter TTL on
        assert await settle(sem.admin.force_release("k", holder.token)) is True
        assert f"semaphore 'k': holder {holder.token} force-released" in caplog.text
        # The slot is reserved for "w": its room is due once the reservation's claim lapses.
        assert published.waiters == ["w"]
        assert _due_in(worker) <= 5.5
        # The reservation taken away: "w" is back in line, and its room due at once.
        assert await settle(sem.admin.force_release("k", "~w")) is True
        assert _due_in(worker) < 0

    with caplog.at_level(logging.WARNING, "celery_semaphore.core.admin"):
        against(scenario, limit=1, claim_timeout=5.0, on_handoff=published)


def test_the_admin_s_live_limit_hands_off_and_logs_alike(
    against: Callable[..., None],
    redis_server: RedisServer,
    published: Published,
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = Semaphore(redis_server.url, limit=1)

    async def scenario(sem: Any) -> None:
        holder = await settle(sem.acquire("k"))
        assert isinstance(worker.room.park("k", "w", b"p"), Parked)
        assert await settle(sem.admin.set_limit("k", 2, by="ops")) is None
        assert "live limit set to 2 (was none) by ops" in caplog.text
        assert published.waiters == ["w"]  # the raise handed the new slot to the parked run
        assert await settle(sem.acquire("k")) is None  # the reservation holds it
        with pytest.raises(SemaphoreValidationError):
            await settle(sem.admin.set_limit("k", 2, by=""))
        assert await settle(sem.admin.set_limit("k", None)) == 2
        assert "live limit cleared (was 2) by " in caplog.text
        assert await settle(holder.release()) is True

    with caplog.at_level(logging.INFO, "celery_semaphore.core.live"):
        against(scenario, limit=1, on_handoff=published)
    assert isinstance(worker.room.claim("k", "w"), Slot)


def test_the_admin_pauses_and_resumes_alike(
    against: Callable[..., None],
    redis_server: RedisServer,
    published: Published,
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = Semaphore(redis_server.url, limit=1)

    async def scenario(sem: Any) -> None:
        assert await settle(sem.admin.pause("k", by="ops")) is False
        assert await settle(sem.admin.pause("k", by="ops")) is True
        assert "semaphore 'k': paused by ops" in caplog.text
        assert "semaphore 'k': already paused (ops asked)" in caplog.text
        paused = await settle(sem.admin.pause_of("k"))
        assert paused.by == "ops"
        assert await settle(sem.acquire("k")) is None
        with pytest.raises(SemaphoreNotAcquiredError) as refused:
            async with holding(sem.hold("k")):
                pass
        assert refused.value.reason is Refusal.PAUSED
        assert isinstance(worker.room.park("k", "w", b"p"), Parked)
        assert await settle(sem.admin.resume("k", by="ops")) is True
        assert "semaphore 'k': resumed by ops" in caplog.text
        assert await settle(sem.admin.pause_of("k")) is None
        assert published.waiters == ["w"]  # the resume handed the free slot to the parked run

    with caplog.at_level(logging.INFO, "celery_semaphore.core.live"):
        against(scenario, limit=1, on_handoff=published)
    assert isinstance(worker.room.claim("k", "w"), Slot)


def test_a_slot_taken_away_is_lost_in_hold(against: Callable[..., None]) -> None:
    async def scenario(sem: Any) -> None:
        with pytest.raises(SemaphoreLeaseLostError):
            async with holding(sem.hold("k", heartbeat=0.1)) as slot:
                assert await settle(sem.admin.force_release_all("k")) == 1
                for _ in range(200):  # the renewal notices within a tick or two
                    if slot.lost.is_set():
                        break
                    await asyncio.sleep(0.05)

    against(scenario, limit=1)


def test_the_admin_scans_keys_and_reads_server_warnings(
    against: Callable[..., None], redis_server: RedisServer
) -> None:
    async def scenario(sem: Any) -> None:
        slots = [await settle(sem.acquire(key)) for key in ("b", "a", "c*{x}")]
        await settle(sem.admin.set_limit("limited", 2))
        await settle(sem.client.zadd("semaphore:{waited}:room", {"w": 1}))
        await settle(sem.client.set("semaphore:{a}:other", 1))  # no semaphore's key
        assert await settle(sem.admin.scan_keys()) == ["a", "b", "c*{x}"]
        assert len(await settle(sem.admin.scan_keys(limit=2))) == 2
        assert await settle(sem.admin.scan_keys(limits=True)) == ["limited"]
        assert await settle(sem.admin.scan_keys(rooms=True)) == ["waited"]
        assert [await settle(slot.release()) for slot in slots] == [True] * 3

        assert await settle(sem.admin.server_warnings()) == []
        config = redis_server.client()
        config.config_set("maxmemory-policy", "allkeys-lru")
        try:
            [warning] = await settle(sem.admin.server_warnings())
            assert "'allkeys-lru'" in warning
        finally:
            config.config_set("maxmemory-policy", "noeviction")
            config.close()

    against(scenario, limit=1)


def test_closing_lets_go_of_the_connections_it_made_and_the_semaphore_works_on(
    against: Callable[..., None], redis_server: RedisServer
) -> None:
    watcher = redis_server.client()

    def connected() -> int:
        return int(watcher.info("clients")["connected_clients"])

    async def scenario(sem: Any) -> None:
        slot = await settle(sem.acquire("k"))
        assert await settle(slot.release()) is True
        before = connected()
        await settle(sem.aclose() if isinstance(sem, AsyncSemaphore) else sem.close())
        for _ in range(200):  # the server sees the sockets close within a moment
            if connected() < before:
                break
            await asyncio.sleep(0.05)
        assert connected() < before
        again = await settle(sem.acquire("k"))  # connects anew
        assert again is not None
        assert await settle(again.release()) is True

    against(scenario, limit=1)
    watcher.close()


@pytest.mark.parametrize(
    "call",
    [
        lambda sem: sem.acquire(""),
        lambda sem: sem.acquire("k", weight=0),
        lambda sem: sem.acquire_many([("a", 1), ("a", 1)]),
        lambda sem: sem.count(""),
        lambda sem: sem.available("k", limit=0),
        lambda sem: sem.admin.set_limit("k", 0),
        lambda sem: sem.admin.holders(""),
        lambda sem: sem.admin.force_release("k", ""),
    ],
)
def test_bad_arguments_are_refused_alike(against: Callable[..., None], call: Any) -> None:
    async def scenario(sem: Any) -> None:
        with pytest.raises(SemaphoreValidationError):
            await settle(call(sem))

    against(scenario, limit=1)


@pytest.mark.parametrize(
    "options",
    [
        {"weight": True},  # equal to 1, yet no weight
        {"retries": True},
        {"retry_delay": -1.0},
        {"retries": 1, "wait": 1.0},
        {"lease": 0},
        {"limit": 0},
        {"metadata": ["n"]},
        {"units": {"nope": 1}},
    ],
    ids=repr,
)
def test_an_acquire_after_plain_ones_is_still_checked_alike(
    against: Callable[..., None], options: dict[str, Any]
) -> None:
    """Both twins check through one planner, which lets a plain call (every option at its
    default) skip the checks once its key was checked: that must not let a call with a bad
    option through on either side."""

    async def scenario(sem: Any) -> None:
        for _ in range(2):
            slot = await settle(sem.acquire("k"))
            await settle(slot.release())
        with pytest.raises(SemaphoreValidationError):
            await settle(sem.acquire("k", **options))
        assert await settle(sem.count("k")) == 0

    against(scenario, limit=2)


@pytest.mark.parametrize(
    "hold",
    [
        lambda sem: sem.hold("k", heartbeat=40.0),  # above half the lease
        lambda sem: sem.hold("k", interrupt=1),
        lambda sem: sem.hold("k", on_renew_error="log"),
        lambda sem: sem.hold_many([("a", 1)], lease=-1.0),
        lambda sem: sem.hold_many([("a", 1)], interrupt="yes"),
        lambda sem: sem.hold_many([("a", 1), ("a", 1)]),
    ],
)
def test_bad_hold_options_are_refused_alike_before_anything_is_taken(
    against: Callable[..., None], hold: Any
) -> None:
    async def scenario(sem: Any) -> None:
        with pytest.raises(SemaphoreValidationError):
            async with holding(hold(sem)):
                pass
        assert [await settle(sem.count(k)) for k in ("k", "a")] == [0, 0]

    against(scenario, limit=1, lease=60.0)


def test_a_semaphore_and_its_admin_send_through_one_set_of_scripts(
    redis_server: RedisServer,
) -> None:
    sem = Semaphore(redis_server.url, limit=1)
    assert sem.admin._scripts is sem._scripts
    assert sem.room._scripts is sem._scripts

    async def main() -> None:
        twin = AsyncSemaphore(redis_server.url, limit=1)
        assert twin.admin._scripts is twin._acquirer.scripts
        await twin.aclose()

    asyncio.run(main())


def test_is_held_asks_the_store_and_changes_nothing(against: Callable[..., None]) -> None:
    async def scenario(sem: Any) -> None:
        slot = await settle(sem.acquire("k"))
        expires_at = slot.expires_at
        assert await settle(slot.is_held()) is True
        assert await settle(slot.is_held()) is True  # asking twice moves nothing
        assert slot.expires_at == expires_at
        assert await settle(sem.count("k")) == 1
        assert await settle(slot.release()) is True
        assert await settle(slot.is_held()) is False
        assert not slot.lost.is_set()

        taken = await settle(sem.acquire("k"))
        assert await settle(sem.admin.force_release("k", taken.token)) is True
        assert await settle(taken.is_held()) is False  # an operator took it
        assert not taken.lost.is_set()  # is_held judges nothing: extend does
        assert await settle(taken.extend()) is False
        assert taken.lost.is_set()

    against(scenario, limit=1)


def test_is_held_is_false_once_the_lease_lapsed(against: Callable[..., None]) -> None:
    async def scenario(sem: Any) -> None:
        slot = await settle(sem.acquire("k", lease=0.3))
        assert await settle(slot.is_held()) is True
        # The lapse is judged by the store's clock: wait until a count no longer sees it.
        for _ in range(400):
            if await settle(sem.count("k")) == 0:
                break
            await asyncio.sleep(0.05)
        assert await settle(sem.count("k")) == 0
        # Still a member of the set (nothing pruned it), yet no longer ours.
        assert await settle(slot.is_held()) is False
        assert await settle(slot.release()) is False

    against(scenario, limit=1)


def test_is_held_of_a_group_is_one_answer_for_every_key(against: Callable[..., None]) -> None:
    async def scenario(sem: Any) -> None:
        group = await settle(sem.acquire_many([("a", 1), ("b", 2, 2)]))
        assert await settle(group.is_held()) is True
        assert await settle(sem.admin.force_release("b", group.token)) is True
        assert await settle(group.is_held()) is False
        assert await settle(group.slots[0].is_held()) is True
        await settle(group.release())

    against(scenario, limit=1)


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_is_held_with_the_store_down_is_a_backend_error(own_redis: RedisServer, kind: str) -> None:
    async def main() -> None:
        sem: Any = (Semaphore if kind == "sync" else AsyncSemaphore)(own_redis.url, limit=2)
        slot = await settle(sem.acquire("k"))
        group = await settle(sem.acquire_many([("a", 1), ("b", 1)]))
        own_redis.stop()
        with pytest.raises(SemaphoreBackendError) as raised:
            await settle(slot.is_held())
        assert raised.value.key == "k"
        with pytest.raises(SemaphoreBackendError):
            await settle(group.is_held())
        if kind == "asyncio":
            await sem.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_hand_off_whose_release_answer_was_lost_is_published_once_the_store_answers(
    own_redis: RedisServer, published: Published, kind: str
) -> None:
    # A client made from a URL gives up on an answer after 5 s; a frozen server runs the
    # call when it wakes. The hand-off that release makes must not wait for its claim lease.
    worker = Semaphore(own_redis.url, limit=1)  # parks a run, as a Celery worker's room does

    async def main() -> None:
        sem: Any = (Semaphore if kind == "sync" else AsyncSemaphore)(
            own_redis.url, limit=1, claim_timeout=120.0, on_handoff=published
        )
        # The release script loaded: the call sent to the frozen server is an EVALSHA it
        # runs when it wakes (on a fresh server it would answer NOSCRIPT, and do nothing).
        assert await settle((await settle(sem.acquire("warm-up"))).release())
        holder = await settle(sem.acquire("k"))
        assert isinstance(worker.room.park("k", "w1", b"p1"), Parked)
        own_redis.pause()
        try:
            with pytest.raises(SemaphoreBackendError):
                await settle(holder.release())
        finally:
            own_redis.resume()
        woke = time.monotonic()
        while published.waiters != ["w1"] and time.monotonic() - woke < 60:
            await asyncio.sleep(0.05)  # the loop runs on: the asyncio side recovers in it
        assert published.waiters == ["w1"]
        assert time.monotonic() - woke < 30, "the hand-off waited for its claim lease"
        if kind == "asyncio":
            await sem.aclose()

    asyncio.run(main())
    assert isinstance(worker.room.claim("k", "w1"), Slot)


async def _until(done: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait, the event loop running on, until ``done()`` (or ``timeout`` seconds)."""
    start = time.monotonic()
    while not done() and time.monotonic() - start < timeout:
        await asyncio.sleep(0.02)
    assert done()


def test_extend_and_release_answer_alike(against: Callable[..., None]) -> None:
    async def scenario(sem: Any) -> None:
        slot = await settle(sem.acquire("k", lease=5.0))
        assert repr(slot).endswith("held>")
        before = slot.deadline
        assert await settle(slot.extend(lease=10.0)) is True
        assert (slot.lease, slot.deadline > before) == (10.0, True)
        with pytest.raises(SemaphoreValidationError):
            await settle(slot.extend(lease=0))
        assert await settle(slot.release()) is True
        assert (slot.released, repr(slot).endswith("released>")) == (True, True)
        assert await settle(slot.extend()) is False  # given back: nothing sent, nothing lost
        assert not slot.lost.is_set()

    against(scenario, limit=1)


def test_a_renewal_that_finds_one_slot_gone_loses_that_one_only(
    against: Callable[..., None],
) -> None:
    async def scenario(sem: Any) -> None:
        seen: list[Any] = []
        with pytest.raises(SemaphoreLeaseLostError, match="a renewal found the slot gone"):
            async with (
                holding(sem.hold("a", heartbeat=0.1)) as lost,
                holding(sem.hold("b", heartbeat=0.1)) as kept,
            ):
                lost.when_lost(seen.append)
                assert await settle(sem.admin.force_release_all("a")) == 1
                await _until(lambda: len(seen) == 1)
                lost.when_lost(seen.append)  # already lost: called at once
                assert seen == [lost, lost]
                assert repr(lost).endswith("lost>")
                assert not kept.lost.is_set()
        assert await settle(sem.count("b")) == 0

    against(scenario, limit=1)


def test_a_shortened_lease_is_renewed_at_its_own_pace(against: Callable[..., None]) -> None:
    async def scenario(sem: Any) -> None:
        async with holding(sem.hold("k", lease=60.0, heartbeat=20.0)) as slot:
            # A third of the new lease, as a third of the old: renewed every 0.5 s, not 20.
            assert await settle(slot.extend(lease=1.5)) is True
            await asyncio.sleep(4.0)
            assert not slot.lost.is_set()
            assert slot.deadline > time.monotonic()
            assert await settle(slot.is_held()) is True

    against(scenario, limit=1)


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_renewal_the_store_does_not_answer_fails_then_the_slot_is_lost_at_its_deadline(
    own_redis: RedisServer, kind: str
) -> None:
    async def main() -> None:
        sem: Any = (Semaphore if kind == "sync" else AsyncSemaphore)(own_redis.url, limit=1)
        errors: list[BaseException] = []
        with pytest.raises(SemaphoreLeaseLostError, match="no renewal succeeded"):
            async with holding(
                sem.hold("k", lease=2.0, heartbeat=0.5, on_renew_error=errors.append)
            ) as slot:
                own_redis.pause()
                try:
                    await _until(slot.lost.is_set)
                finally:
                    own_redis.resume()
        assert errors
        assert all(isinstance(error, SemaphoreBackendError) for error in errors)
        assert any("did not answer a renewal" in str(error) for error in errors)
        if kind == "asyncio":
            await sem.aclose()

    asyncio.run(main())
