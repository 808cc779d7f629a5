"""A run that needs several keys keeps its turn (issue 22, "No run waits for ever"), on a
real Redis: it waits in the room of every key it needs, later single-key runs do not pass it
indefinitely, it holds no unit idle while older runs are ahead of it elsewhere, it is handed
off once, when it holds every key, and a cancel, a give-up or a lapsed reservation leaves no
unit stranded. The runs here are driven by hand (``Fleet``): a run holds its slot until the
test finishes it, and hand-offs are claimed in the order they were published."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from celery_semaphore import Semaphore
from celery_semaphore.core.group import SlotGroup
from celery_semaphore.core.names import redis_keys
from celery_semaphore.core.replies import Parked
from celery_semaphore.core.slot import Slot
from celery_semaphore.testing import RedisServer

from .helpers import Published, wait_for
from .servers import ClusterServers

Keys = Sequence[tuple[str, int]]


class Fleet:
    """Runs parked and claimed through one semaphore's room, each holding what it took until
    :meth:`finish`; hand-offs are claimed in the order they were published, as a broker would
    deliver them. ``started`` lists the runs in the order they started."""

    def __init__(self, sem: Semaphore, published: Published) -> None:
        self.sem, self.published = sem, published
        self.asks: dict[str, Keys] = {}
        self.running: dict[str, Slot | SlotGroup] = {}
        self.started: list[str] = []
        self.delivered = 0
        self.clock = time.time()

    def park(self, name: str, keys: Keys) -> Parked | None:
        """Park run ``name`` for ``keys`` (one or several), a little after the last one."""
        self.asks[name] = keys
        self.clock += 0.01  # arrivals in the order of the calls, never tied
        if len(keys) == 1:
            key, limit = keys[0]
            result: Any = self.sem.room.park(key, name, name.encode(), limit=limit,
                                             arrival=self.clock)  # fmt: skip
        else:
            result = self.sem.room.park_many(keys, name, name.encode(), arrival=self.clock)
        self._took(name, result)
        self.deliver()
        return result if isinstance(result, Parked) else None

    def deliver(self) -> None:
        """Claim every hand-off published since the last call, in order."""
        while self.delivered < len(self.published.handoffs):
            _, name, _ = self.published.handoffs[self.delivered]
            self.delivered += 1
            keys = self.asks[name]
            if not keys:  # its message was lost
                continue
            if len(keys) == 1:
                key, limit = keys[0]
                self._took(name, self.sem.room.claim(key, name, limit=limit))
            else:
                self._took(name, self.sem.room.claim_many(keys, name))

    def finish(self, name: str) -> None:
        self.running.pop(name).release()
        self.deliver()

    def _took(self, name: str, result: object) -> None:
        if isinstance(result, (Slot, SlotGroup)):
            self.running[name] = result
            self.started.append(name)


@pytest.fixture
def fleet(redis_server: RedisServer, client: redis.Redis) -> Iterator[Fleet]:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    yield Fleet(sem, published)
    sem.client.close()


PROVIDER, TENANT = ("provider", 1), ("tenant:a", 1)


def test_a_run_of_two_keys_is_not_passed_indefinitely_by_single_key_backlogs(
    fleet: Fleet,
) -> None:
    """Both keys busy, each with a backlog of its own; the run of both keys arrives, and
    single-key runs keep arriving on both after it. Before, it waited in one room at a time
    and passed each slot it was handed on while the other key was busy: it lost its turn
    again and again (in the issue, 17 of 24 later runs started first)."""
    for name, key in [("p0", PROVIDER), ("t0", TENANT), ("p1", PROVIDER), ("t1", TENANT),
                      ("p2", PROVIDER), ("t2", TENANT)]:  # fmt: skip
        fleet.park(name, [key])
    assert fleet.started == ["p0", "t0"]
    assert isinstance(fleet.park("both", [PROVIDER, TENANT]), Parked)
    later: list[str] = []
    for step in range(24):
        if "both" in fleet.running:
            break
        fleet.finish(next(iter(fleet.running)))  # the oldest running run ends
        for name, key in [(f"p{step + 3}", PROVIDER), (f"t{step + 3}", TENANT)]:
            later.append(name)
            fleet.park(name, [key])
    assert "both" in fleet.started, f"still waiting after 24 steps; started {fleet.started}"
    before = fleet.started[: fleet.started.index("both")]
    passed = [name for name in before if name in later]
    # It is first in each room once the backlogs ahead of it are through: at most one later
    # run starts in the slot it lets pass while the other key is still busy.
    assert len(passed) <= 1, f"{len(passed)} later runs started first: {passed}"
    assert {"p1", "p2", "t1", "t2"} <= set(before)  # the older runs went first


def test_it_lets_its_first_turn_pass_keeps_its_second_and_is_handed_off_once(
    fleet: Fleet, client: redis.Redis
) -> None:
    fleet.park("p0", [PROVIDER])
    fleet.park("t0", [TENANT])
    assert isinstance(fleet.park("both", [PROVIDER, TENANT]), Parked)
    # tenant:a's turn comes while the provider is busy: kept, the unit would idle (with many
    # tenants, one per busy tenant), so it lets it pass, keeping its place.
    fleet.finish("t0")
    assert fleet.sem.count("tenant:a") == 0
    fleet.park("t1", [TENANT])
    assert fleet.started[-1] == "t1"
    # The provider's turn: now it keeps the unit, and tenant:a's next one is its own.
    fleet.finish("p0")
    [held] = fleet.sem.admin.holders("provider")
    assert (held.metadata["reserved_for"], held.metadata["waiting"]) == ("both", True)
    fleet.park("t2", [TENANT])
    assert [w.waiter for w in fleet.sem.room.waiters("tenant:a")] == ["both", "t2"]
    assert fleet.published.waiters == []  # not handed off while it holds one key only
    fleet.finish("t1")
    assert fleet.published.waiters == ["both"]  # once, holding both
    group = fleet.running["both"]
    assert isinstance(group, SlotGroup)
    assert [s.key for s in group.slots] == ["provider", "tenant:a"]
    fleet.finish("both")
    assert fleet.started[-2:] == ["both", "t2"]
    fleet.finish("t2")
    assert [fleet.sem.count(k) for k in ("provider", "tenant:a")] == [0, 0]
    for key in ("provider", "tenant:a"):  # nothing of it is left in its rooms (the room's own
        assert [f for f in client.hkeys(redis_keys("semaphore", key).parked)  # marks may be)
                if f not in (b"!limit", b"!ttl", b"!due")] == []  # fmt: skip


def test_runs_waiting_for_a_busy_tenant_hold_no_provider_unit(fleet: Fleet) -> None:
    """The per-tenant case: tenant a's backlog waits for tenant:a, and keeps none of the
    provider's units meanwhile, so tenant b's runs start at once."""
    keys_a, keys_b = [("provider", 4), ("tenant:a", 1)], [("provider", 4), ("tenant:b", 1)]
    for n in range(5):
        fleet.park(f"a{n}", keys_a)
    assert fleet.started == ["a0"]
    fleet.park("b0", keys_b)
    fleet.park("b1", keys_b)
    assert fleet.started == ["a0", "b0"]
    assert fleet.sem.count("provider") == 2
    for name in ("a0", "b0", "a1", "b1", "a2", "a3"):
        fleet.finish(name)
    assert fleet.started == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]  # tenant a in order
    fleet.finish("a4")
    assert [fleet.sem.count(k) for k in ("provider", "tenant:a", "tenant:b")] == [0, 0, 0]


def _holding_the_provider(fleet: Fleet) -> None:
    """'both' keeps the provider's unit and waits for tenant:a; 'p1' waits for the provider
    behind it, 't2' for tenant:a."""
    fleet.park("p0", [PROVIDER])
    fleet.park("t0", [TENANT])
    fleet.park("both", [PROVIDER, TENANT])
    fleet.finish("t0")  # lets tenant:a's unit pass ...
    fleet.park("t1", [TENANT])
    fleet.park("p1", [PROVIDER])
    fleet.park("t2", [TENANT])
    fleet.finish("p0")  # ... and keeps the provider's
    [held] = fleet.sem.admin.holders("provider")
    assert held.metadata["reserved_for"] == "both"


def _nothing_left_of(fleet: Fleet, client: redis.Redis, waiter: str) -> None:
    for key in ("provider", "tenant:a"):
        names = redis_keys("semaphore", key)
        fields = [f.decode() for f in client.hkeys(names.parked)]
        assert not [f for f in fields if waiter in f], f"{key}: {fields}"
        assert client.zscore(names.room, waiter) is None
        assert client.zscore(names.slots, f"~{waiter}") is None
        assert client.zscore(names.deadlines, waiter) is None


def test_a_cancel_in_one_room_takes_it_out_of_every_room_and_frees_its_units(
    fleet: Fleet, client: redis.Redis
) -> None:
    _holding_the_provider(fleet)
    assert fleet.sem.room.cancel("tenant:a", "both")  # revoked: its worker knows one key
    _nothing_left_of(fleet, client, "both")
    fleet.deliver()
    assert fleet.started[-1] == "p1"  # the provider's unit went to the next in line
    assert not fleet.sem.room.cancel("provider", "both")
    for name in ("t1", "p1"):
        fleet.finish(name)
    assert fleet.started[-1] == "t2"
    fleet.finish("t2")
    assert [fleet.sem.count(k) for k in ("provider", "tenant:a")] == [0, 0]


def test_a_give_up_is_sent_from_the_room_it_waits_in_and_its_cancel_frees_every_unit(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published)
    fleet = Fleet(sem, published)
    fleet.park("p0", [PROVIDER])
    fleet.park("t0", [TENANT])
    assert isinstance(sem.room.park_many([PROVIDER, TENANT], "both", b"both", budget=0.5),
                      Parked)  # fmt: skip
    fleet.asks["both"] = [PROVIDER, TENANT]
    fleet.finish("t0")
    fleet.park("t1", [TENANT])
    fleet.finish("p0")  # it keeps the provider's unit, and waits in tenant:a's order
    deadlines = [client.zscore(redis_keys("semaphore", k).deadlines, "both") for k in
                 ("provider", "tenant:a")]  # fmt: skip
    assert deadlines[0] is not None
    assert deadlines[0] == deadlines[1]

    def given_up() -> bool:
        sem.room.sweep("provider")  # reserved there: no give-up from this room
        sem.room.sweep("tenant:a")
        return bool(published.give_ups)

    wait_for(given_up, timeout=10)
    assert published.give_ups[0] == "both"
    # Its run cancels itself on each key, as give_up_or_end does: the first finds it.
    assert [sem.room.cancel(k, "both") for k in ("provider", "tenant:a")] == [True, False]
    _nothing_left_of(fleet, client, "both")
    assert sem.count("provider") == 0  # nobody waits for it: the unit is free
    fleet.finish("t1")
    sem.client.close()


def test_a_kept_reservation_that_lapses_is_kept_again_in_its_place_and_never_taken(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published, claim_timeout=0.3,
                    handoff_grace=0.05)  # fmt: skip
    fleet = Fleet(sem, published)
    _holding_the_provider(fleet)
    first = client.zscore(redis_keys("semaphore", "provider").slots, "~both")
    # Its claim lease ends while tenant:a is busy: a sweep puts it back at its place, which
    # is first, and reserves the unit for it again.
    wait_for(lambda: sem.room.sweep("provider") >= 0
             and (client.zscore(redis_keys("semaphore", "provider").slots, "~both") or 0)
             > (first or 0), timeout=10)  # fmt: skip
    [held] = sem.admin.holders("provider")
    assert held.metadata["reserved_for"] == "both"
    # A run that asks in person past the grace does not take it: no message is on its way.
    assert isinstance(fleet.park("p2", [PROVIDER]), Parked)
    assert [h.metadata.get("reserved_for") for h in sem.admin.holders("provider")] == ["both"]
    fleet.finish("t1")
    assert fleet.started[-1] == "both"
    fleet.finish("both")
    for name in ("p1", "t2"):
        fleet.finish(name)
    fleet.finish("p2")
    assert [sem.count(k) for k in ("provider", "tenant:a")] == [0, 0]
    _nothing_left_of(fleet, client, "both")
    sem.client.close()


def test_a_hand_off_never_claimed_is_handed_off_again_once_its_reservations_lapse(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=1, on_handoff=published, claim_timeout=0.3)
    fleet = Fleet(sem, published)
    _holding_the_provider(fleet)
    fleet.asks["both"] = []  # its message is lost: the fleet does not claim it
    fleet.finish("t1")
    assert published.waiters.count("both") == 1
    wait_for(lambda: sem.room.sweep("provider") >= 0 and sem.room.sweep("tenant:a") >= 0
             and published.waiters.count("both") == 2, timeout=10)  # fmt: skip
    group = sem.room.claim_many([PROVIDER, TENANT], "both")
    assert isinstance(group, SlotGroup)
    assert group.release()
    sem.client.close()


def test_on_a_cluster_it_waits_in_every_room_and_is_gathered_and_cancelled_there(
    cluster: ClusterServers,
) -> None:
    published = Published()
    sem = Semaphore(cluster.url, limit=1, on_handoff=published)
    provider, tenant = ("{llm}provider", 1), ("{llm}tenant:a", 1)
    fleet = Fleet(sem, published)
    fleet.park("p0", [provider])
    fleet.park("t0", [tenant])
    fleet.park("both", [provider, tenant])
    fleet.park("gone", [provider, tenant])
    fleet.finish("t0")
    fleet.finish("p0")  # gathered on the cluster: 'both' holds both and is handed off
    assert published.waiters == ["both"]
    assert sem.room.cancel("{llm}tenant:a", "gone")  # out of both rooms in one call
    assert [w.waiter for w in sem.room.waiters("{llm}provider")] == []
    fleet.finish("both")
    assert [sem.count(k) for k, _ in (provider, tenant)] == [0, 0]
    sem.client.close()
