"""High availability: the semaphore on a Redis Cluster and behind Redis Sentinel.

Each set-up is started once for the module (a 3-primary cluster; a primary, a replica and one
Sentinel) and emptied before each test. The failover tests swap the Sentinel set's primary:
the tests after them run on the promoted one, found through the Sentinel as a user's are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from celery import Celery

from celery_semaphore import (
    Semaphore,
    SemaphoreBackendError,
    SemaphoreLeaseLostError,
    SemaphoreTask,
    SemaphoreValidationError,
    Slot,
    current_slot,
)
from celery_semaphore.core.admin import SemaphoreAdmin
from celery_semaphore.core.clients import client_from_url
from celery_semaphore.core.names import redis_keys
from celery_semaphore.integration.settings import app_settings, journal_for
from celery_semaphore.integration.waiting_room.incarnation import marker_key
from celery_semaphore.integration.waiting_room.keeper import JournalKeeper
from celery_semaphore.testing import RedisServer
from celery_semaphore.views.inspection import views

from .celery_apps import make_app
from .helpers import acquire_at_once, assert_force_release_is_reported, run_callers, wait_for
from .history import BODIES, History
from .servers import ClusterServers, SentinelServers
from .test_journal import park_journaled

MakeSemaphore = Callable[..., Semaphore]


@pytest.fixture
def on_cluster(cluster: ClusterServers) -> Iterator[MakeSemaphore]:
    """``on_cluster(limit=...)``: a semaphore made from the cluster's URL, on an empty cluster."""
    admin = cluster.client()
    admin.flushall()  # every primary
    admin.close()
    made: list[Semaphore] = []

    def make(**kwargs: object) -> Semaphore:
        sem = Semaphore(cluster.url, **kwargs)  # type: ignore[arg-type]
        made.append(sem)
        return sem

    yield make
    for sem in made:
        sem.client.close()


@pytest.fixture
def master(sentinel_set: SentinelServers) -> Iterator[redis.Redis]:
    """A Sentinel-managed client for the current primary, which is emptied first."""
    client = sentinel_set.master_client()
    client.flushall()
    yield client
    client.close()


def _take_25_on_limit_20(sem: Semaphore, key: str) -> None:
    results: list[Slot | None] = acquire_at_once(sem, key, 25)
    slots = [s for s in results if s is not None]
    assert len(slots) == 20
    assert results.count(None) == 5
    assert sem.count(key) == 20
    assert len(sem.admin.holders(key)) == 20
    assert len({s.token for s in slots}) == 20
    assert all(s.release() for s in slots)
    assert sem.count(key) == 0


def _run_50_on_limit_5(sem: Semaphore, key: str, recorder: redis.Redis) -> None:
    """50 callers through ``sem`` (limit 5), their bodies recorded through ``recorder``."""
    callers = run_callers(sem, key, recorder, 50)
    History.load(recorder, BODIES).assert_ok({key: 5}, tasks=callers)
    assert sem.count(key) == 0


def _hold_through_three_leases(sem: Semaphore, key: str) -> None:
    """``sem`` has limit 1 and a 1 s lease; the body runs 3 s while others try to get in."""
    intruders: list[Slot] = []
    with sem.hold(key) as slot:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            other = sem.acquire(key)
            if other is not None:
                intruders.append(other)
            assert not slot.lost.wait(0.1)
    assert intruders == []
    assert not slot.lost.is_set()
    assert sem.count(key) == 0


def _run_a_bounded_task(url: str) -> None:
    """A bounded task called directly, with ``semaphore_url`` set to ``url``."""
    app = Celery("ha", set_as_current=False)
    app.conf.semaphore_url = url
    probe = Semaphore(url, limit=1)

    @app.task(base=SemaphoreTask, semaphore="tenant:{tenant}", limit=1, shared=False,
              name="ha.call")  # fmt: skip
    def call(tenant: str) -> tuple[str, int]:
        slot = current_slot()
        assert slot is not None
        return slot.key, probe.count(slot.key)

    assert call("acme") == ("tenant:acme", 1)
    assert probe.count("tenant:acme") == 0
    probe.client.close()


# --- Redis Cluster ---------------------------------------------------------------------------


def test_cluster_url_makes_a_cluster_client(cluster: ClusterServers) -> None:
    client = client_from_url(cluster.url)
    assert isinstance(client, redis.RedisCluster)
    assert len(client.get_primaries()) == 3
    client.close()
    one_node = client_from_url(f"redis+cluster://127.0.0.1:{cluster.nodes[1].port}")
    assert len(one_node.get_primaries()) == 3  # learnt from the node it was given
    one_node.close()


def test_cluster_25_callers_on_limit_20_get_exactly_20_slots(on_cluster: MakeSemaphore) -> None:
    _take_25_on_limit_20(on_cluster(limit=20), "openai")


def test_cluster_50_threads_on_limit_5_never_exceed_5(
    on_cluster: MakeSemaphore, client: redis.Redis
) -> None:
    _run_50_on_limit_5(on_cluster(limit=5, lease=10.0), "legacy-api", client)


def test_cluster_hold_keeps_its_slot_through_a_body_three_times_the_lease(
    on_cluster: MakeSemaphore,
) -> None:
    _hold_through_three_leases(on_cluster(limit=1, lease=1.0), "long")


def test_cluster_force_release_all_makes_the_next_renewal_report_loss(
    on_cluster: MakeSemaphore,
) -> None:
    assert_force_release_is_reported(on_cluster(limit=3, lease=2.0), on_cluster(limit=3).admin)


KEYS = ["openai", "tenant:acme", "{braces}", "a}b{c", "{", "x}", "ünïcødé ✓", "with spaces",
        "k" * 300, "{}", "a{}b"]  # fmt: skip


def test_cluster_keys_of_every_shape_spread_over_the_nodes(
    cluster: ClusterServers, on_cluster: MakeSemaphore
) -> None:
    sem = on_cluster(limit=2, lease=30.0)
    client = sem.client
    assert isinstance(client, redis.RedisCluster)
    nodes = set()
    for key in KEYS:
        keys = redis_keys(sem.prefix, key)
        assert len({client.keyslot(name) for name in keys}) == 1, key
        nodes.add(client.get_node_from_key(keys.slots).name)
    assert len(nodes) == 3, "the keys should exercise every primary"

    slots = {key: sem.acquire(key, metadata={"key": key}) for key in KEYS}
    assert all(slot is not None for slot in slots.values())
    for key in KEYS:
        assert sem.count(key) == 1
        [holder] = sem.admin.holders(key)
        assert holder.metadata["key"] == key
    # SCAN visits every primary, so inspection sees all of them.
    assert SemaphoreAdmin(client).scan_keys() == sorted(KEYS)
    assert {v.key: v.in_use for v in views(client)} == dict.fromkeys(KEYS, 1)
    for key in KEYS:
        assert sem.acquire(key) is not None
        assert sem.acquire(key) is None  # limit 2, held twice
        assert sem.admin.force_release_all(key) == 2
    assert SemaphoreAdmin(client).scan_keys() == []


def test_cluster_rejects_a_key_starting_with_a_closing_brace(on_cluster: MakeSemaphore) -> None:
    # "semaphore:{}lead}" has an empty hash tag: its two keys would hash to different slots.
    sem = on_cluster(limit=1)
    client = sem.client
    assert isinstance(client, redis.RedisCluster)
    keys = redis_keys(sem.prefix, "}lead")
    assert client.keyslot(keys.slots) != client.keyslot(keys.holders)
    calls: list[Callable[[], object]] = [
        lambda: sem.acquire("}lead"),
        lambda: sem.hold("}lead").__enter__(),
        lambda: sem.count("}lead"),
        lambda: sem.admin.holders("}lead"),
        lambda: sem.admin.force_release("}lead", "token"),
        lambda: sem.admin.force_release_all("}lead"),
        lambda: sem.room.park("}lead", "w", b""),
        lambda: sem.room.claim("}lead", "w"),
        lambda: sem.room.sweep("}lead"),
        lambda: sem.room.cancel("}lead", "w"),
    ]
    for call in calls:
        with pytest.raises(SemaphoreValidationError, match="starts with '}'") as info:
            call()
        assert info.value.key == "}lead"
    # A closing brace anywhere else is fine.
    slot = sem.acquire("lead}")
    assert slot is not None
    assert slot.release()


def test_cluster_url_as_semaphore_url_of_a_celery_app(
    cluster: ClusterServers, on_cluster: MakeSemaphore
) -> None:
    _run_a_bounded_task(cluster.url)


def test_cluster_url_errors() -> None:
    with pytest.raises(SemaphoreValidationError, match="database 0"):
        client_from_url("redis+cluster://127.0.0.1:1/3")
    with pytest.raises(SemaphoreValidationError, match="host is missing"):
        client_from_url("redis+cluster://127.0.0.1:1,")
    with pytest.raises(SemaphoreValidationError, match="port"):
        client_from_url("redis+cluster://127.0.0.1:http")
    with pytest.raises(SemaphoreValidationError, match="socket_timeout"):
        client_from_url("redis+cluster://127.0.0.1:1?socket_timeout=soon")
    # Unlike the other clients, a cluster client connects at once.
    with pytest.raises(SemaphoreBackendError, match="cannot reach Redis Cluster"):
        Semaphore("redis+cluster://127.0.0.1:1", limit=1)


def test_a_cluster_with_every_node_down_is_a_backend_error() -> None:
    with ClusterServers() as own:
        sem = Semaphore(own.url, limit=1)
        assert sem.acquire("k") is not None
        own.stop()
        with pytest.raises(SemaphoreBackendError):
            sem.acquire("k")
        sem.client.close()


# --- Redis Sentinel --------------------------------------------------------------------------


def test_sentinel_url_forms_and_settings(sentinel_set: SentinelServers) -> None:
    port = sentinel_set.sentinel.port
    client = client_from_url(f"redis+sentinel://127.0.0.1:{port}/mymaster/2?socket_timeout=3")
    pool = client.connection_pool
    assert pool.service_name == "mymaster"  # type: ignore[attr-defined]
    assert pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["socket_timeout"] == 3.0
    client.close()
    for bad in ("redis+sentinel://127.0.0.1:1", "redis+sentinel://127.0.0.1:1/m/x"):
        with pytest.raises(SemaphoreValidationError, match="service_name"):
            client_from_url(bad)
    app = Celery("ha", set_as_current=False)
    app.conf.semaphore_url = sentinel_set.url
    assert app_settings(app).url == sentinel_set.url


@pytest.mark.parametrize("via", ["master_for", "url"])
def test_sentinel_25_callers_on_limit_20_get_exactly_20_slots(
    sentinel_set: SentinelServers, master: redis.Redis, via: str
) -> None:
    sem = Semaphore(master if via == "master_for" else sentinel_set.url, limit=20)
    _take_25_on_limit_20(sem, "openai")
    sem.client.close()


@pytest.mark.parametrize("via", ["master_for", "url"])
def test_sentinel_50_threads_on_limit_5_never_exceed_5(
    sentinel_set: SentinelServers, master: redis.Redis, via: str, client: redis.Redis
) -> None:
    sem = Semaphore(master if via == "master_for" else sentinel_set.url, limit=5, lease=10.0)
    _run_50_on_limit_5(sem, "legacy-api", client)
    sem.client.close()


def test_sentinel_hold_keeps_its_slot_through_a_body_three_times_the_lease(
    sentinel_set: SentinelServers, master: redis.Redis
) -> None:
    sem = Semaphore(sentinel_set.url, limit=1, lease=1.0)
    _hold_through_three_leases(sem, "long")
    sem.client.close()


def test_sentinel_url_as_semaphore_url_of_a_celery_app(
    sentinel_set: SentinelServers, master: redis.Redis
) -> None:
    _run_a_bounded_task(sentinel_set.url)


def test_sentinel_force_release_all_and_inspection(
    sentinel_set: SentinelServers, master: redis.Redis
) -> None:
    sem = Semaphore(sentinel_set.url, limit=3, lease=2.0)
    with pytest.raises(SemaphoreLeaseLostError), sem.hold("shared", heartbeat=0.2) as slot:
        assert SemaphoreAdmin(master).scan_keys() == ["shared"]
        assert sem.admin.holders("shared")[0].token == slot.token
        assert Semaphore(master, limit=3).admin.force_release_all("shared") == 1
        assert slot.lost.wait(10), "the heartbeat never noticed the slot was gone"
    assert sem.count("shared") == 0
    sem.client.close()


def test_a_failover_keeps_replicated_slots_and_reports_a_lost_write(
    sentinel_set: SentinelServers, master: redis.Redis
) -> None:
    sem = Semaphore(sentinel_set.url, limit=1, lease=5.0)
    slots: dict[str, Slot] = {}
    outcomes: dict[str, str] = {}
    renew_errors: list[BaseException] = []
    done = threading.Event()

    def holder(key: str) -> None:
        try:
            with sem.hold(key, heartbeat=0.25, on_renew_error=renew_errors.append) as slot:
                slots[key] = slot
                while not done.is_set() and not slot.lost.wait(0.05):
                    pass
            outcomes[key] = "kept"
        except SemaphoreLeaseLostError:
            outcomes[key] = "lost"

    threads = [threading.Thread(target=holder, args=(key,)) for key in ("kept", "dropped")]
    for t in threads:
        t.start()
    try:
        assert wait_for(lambda: len(slots) == 2, timeout=30)
        old, replica = sentinel_set.primary(), sentinel_set.replica()
        on_replica = replica.client()
        # Both slots have reached the replica before it is promoted.
        assert wait_for(
            lambda: all(
                on_replica.zscore(redis_keys(sem.prefix, key).slots, slot._member) is not None
                for key, slot in slots.items()
            ),
            timeout=30,
        )
        on_replica.close()

        promoted = sentinel_set.failover()
        assert promoted is replica
        assert sentinel_set.primary() is replica
        on_new = replica.client()
        # A write the failover lost: the "dropped" holder's slot is not on the new primary.
        dropped_keys = redis_keys(sem.prefix, "dropped")
        assert on_new.zrem(dropped_keys[0], slots["dropped"]._member) == 1
        assert slots["dropped"].lost.wait(30), "the lost write was never noticed"

        # The "kept" holder renews on the new primary: its expiry there moves forward.
        kept_key = redis_keys(sem.prefix, "kept").slots
        first = on_new.zscore(kept_key, slots["kept"]._member)
        assert first is not None
        assert wait_for(
            lambda: (on_new.zscore(kept_key, slots["kept"]._member) or 0) > first, timeout=30
        )
        assert not slots["kept"].lost.is_set()
        assert sem.acquire("kept") is None  # still held, on the new primary
        on_new.close()
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
    assert outcomes == {"kept": "kept", "dropped": "lost"}
    assert "gone" in str(slots["dropped"].lease_lost_error())
    # Renewals may fail while clients move to the new primary; none was judged a loss.
    assert all(isinstance(e, SemaphoreBackendError) for e in renew_errors)
    assert sem.count("kept") == 0
    assert sem.count("dropped") == 0
    on_old = old.client()
    assert on_old.info("replication")["role"] == "slave"
    on_old.close()
    sem.client.close()


def test_the_waiting_room_works_on_a_cluster(on_cluster: MakeSemaphore) -> None:
    handed: list[str] = []
    sem = on_cluster(limit=1)
    sem.handoffs.publisher = lambda key, handoffs: handed.extend(h.waiter for h in handoffs)
    for key in KEYS:
        holder = sem.acquire(key)
        assert holder is not None
        assert not isinstance(sem.room.park(key, "w", b"p"), Slot)
        holder.release()
        claimed = sem.room.claim(key, "w")
        assert isinstance(claimed, Slot), key
        claimed.release()
    assert handed == ["w"] * len(KEYS)


def test_a_fleet_takes_and_sweeps_the_rooms_of_many_nodes_on_a_cluster(
    on_cluster: MakeSemaphore,
) -> None:
    handed: list[str] = []
    sem = on_cluster(limit=1)
    mute = on_cluster(limit=1)  # its release reserves nothing: the sweeps hand the slots out
    sem.handoffs.publisher = lambda key, handoffs: handed.extend(h.waiter for h in handoffs)
    for key in KEYS:
        holder = mute.acquire(key)
        assert holder is not None
        sem.room.park(key, f"w-{key}", b"p")
        holder.release()
    due = sem.room.index.due(interval=60.0, count=100, ttl=60.0)
    assert sorted(due.keys) == sorted(KEYS)  # the index is one key, on one node
    assert sem.room.sweep_many(due.keys) == len(KEYS)  # one pipeline over every node
    assert sorted(handed) == sorted(f"w-{key}" for key in KEYS)
    for key in KEYS:
        assert isinstance(sem.room.claim(key, f"w-{key}"), Slot)
    assert sem.room.index.backstop(every=60.0, owner="test", ttl=60.0) == 0


@pytest.mark.parametrize("setting", ["broker_url", "result_backend"])
def test_a_sentinel_broker_or_backend_is_the_default_store(
    sentinel_set: SentinelServers, setting: str
) -> None:
    from celery import Celery

    from celery_semaphore.integration.settings import app_settings, client_for

    sentinel = f"sentinel://127.0.0.1:{sentinel_set.sentinel.port}/0"
    options = {"master_name": sentinel_set.service_name}
    app = Celery("sentinel-store", set_as_current=False)
    if setting == "broker_url":
        app.conf.update(broker_url=sentinel, broker_transport_options=options)
    else:
        app.conf.update(broker_url="amqp://guest@127.0.0.1//", result_backend=sentinel,
                        result_backend_transport_options=options)  # fmt: skip
    assert app_settings(app).store.setting == setting
    client_for(app).set(f"probe:{setting}", 1)
    assert sentinel_set.master_client().get(f"probe:{setting}") == b"1"


def test_a_failover_to_a_replica_that_missed_writes_loses_no_decision_and_no_parked_run(
    sentinel_set: SentinelServers,
    master: redis.Redis,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    """Proves the guarantees table's failover row: a promoted replica that missed the last
    writes (a pause, a live limit, three parks) is a new incarnation of the store (its own
    ``run_id``), so a worker's next ticks put the decisions back, in one ERROR line each, and
    its host's journal sends the three parked runs again, as after an older snapshot."""
    app = make_app(redis_server.url, semaphore_url=sentinel_set.url)
    request.addfinalizer(app.close)
    admin = SemaphoreAdmin(master, "semaphore")
    worker = JournalKeeper(app)
    worker.keep()  # the incarnation the writes below are made under
    admin.pause("fo:paused", by="ops")
    admin.set_limit("fo:limited", 1, by="ops")
    sem = Semaphore(sentinel_set.url, limit=1)
    request.addfinalizer(sem.close)
    assert sem.acquire("fo:room") is not None
    parked = park_journaled(app, sem, "fo:room", 3)
    worker.keep()  # the decisions, as the worker saw them before the failover
    replica = sentinel_set.replica().client()
    room = redis_keys("semaphore", "fo:room").room
    assert wait_for(lambda: replica.zcard(room) == 3 and replica.hlen("semaphore:decisions") == 2)
    replica.close()

    new = sentinel_set.failover().client()
    # The writes the promoted replica missed: all but the store's incarnation marker.
    for name in new.keys("semaphore*"):
        if name != marker_key("semaphore").encode():
            new.delete(name)
    new.close()
    caplog.set_level(logging.INFO)

    def put_right() -> bool:
        worker.keep()
        return (
            admin.pause_of("fo:paused") is not None
            and getattr(admin.live_limit("fo:limited"), "limit", None) == 1
            and sum("sent lost run" in r.getMessage() for r in caplog.records) == 3
        )

    assert wait_for(put_right, timeout=30)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert sum("a restart of the store lost its pause" in line for line in lines) == 1
    assert sum("a restart of the store lost its live limit 1" in line for line in lines) == 1
    journal = journal_for(app)
    assert journal is not None
    assert not {entry.waiter for entry in journal.page(0, 1000)} & set(parked)
