"""Faults in the waiting room (``on_full="queue"``): killed releasers and workers, a restarted
store, expired and revoked parked runs. Real redis-server processes, real Celery workers.

Every test uses ``csem.gate`` (tests/celery_apps.py: key "gate", limit 1, lease 2 s), whose
runs record their starts and ends in the tests' history (tests/history.py), so the test
judges body runs without the library's help. Hand-offs made by the test itself reserve a slot
for 2 s (``_holder``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.signals import task_postrun

from celery_semaphore import Semaphore, Slot
from celery_semaphore.core.names import redis_keys
from celery_semaphore.integration.waiting_room import incarnation
from celery_semaphore.integration.waiting_room.handoffs import publisher_for
from celery_semaphore.integration.waiting_room.queues import SUFFIX
from celery_semaphore.testing import RedisServer

from .celery_apps import BLOCKING, GATE_OPEN, STALLED_PUBLISH, add_room_fault_tasks, make_app
from .helpers import (
    AMQP_URL,
    child_pids,
    delete_queues,
    kill_worker,
    prefork_worker_process,
    queued,
    rabbitmq_up,
    unacked_task_ids,
    wait_for,
)
from .history import BODIES, History

KEY = "gate"


class RunLost(AssertionError):
    """A run that Celery's delivery settings promise to run never finished."""


@pytest.fixture
def gate_app(app: Celery) -> Celery:
    """The tests' app on the shared server, with the waiting room's fault-test tasks."""
    return add_room_fault_tasks(app)


def _holder(app: Celery) -> Semaphore:
    """A semaphore of the gate's key that hands its released slots off as a worker would."""
    return Semaphore(
        app.conf.semaphore_url, limit=1, claim_timeout=2.0, on_handoff=publisher_for(app)
    )


def _started(client: redis.Redis, completed: bool = False) -> list[int]:
    """The ``n`` of each gate run that started (or ``completed``), in the order they started."""
    return History.load(client, BODIES).values("n", completed=completed)


def _check(client: redis.Redis, *tasks: str, killed: tuple[str, ...] = ()) -> None:
    """The history holds: one gate body at a time, each of ``tasks`` ran once, no other task
    ran, and no run was left unfinished but the one of each ``killed`` task."""
    History.load(client, BODIES).assert_ok({KEY: 1}, tasks=tasks, killed=killed)


def _room(sem: Semaphore) -> list[str]:
    return [w.waiter for w in sem.room.waiters(KEY)]


def _park(
    app: Celery, sem: Semaphore, *runs: tuple[Any, ...], task: str = "csem.gate"
) -> list[Any]:
    """Send ``task`` runs (``csem.gate`` or its twin) one by one, each parked before the next
    is sent (so the room holds them after those already there, in that order)."""
    results: list[Any] = []
    before = _room(sem)
    for args in runs:
        results.append(app.tasks[task].apply_async(args))
        ids = before + [r.id for r in results]
        assert wait_for(lambda ids=ids: _room(sem) == ids, timeout=60), (_room(sem), ids)
    return results


def _drained(sem: Semaphore) -> bool:
    return sem.count(KEY) == 0 and _room(sem) == []


def _broker_idle(client: redis.Redis) -> bool:
    """No task message waits in the broker's queue or is out for delivery."""
    return queued(client) == 0 and unacked_task_ids(client) == []


@contextmanager
def _worker(app: Celery, pool: str, tmp_path: Path) -> Iterator[None]:
    if pool == "prefork":
        with prefork_worker_process(app, tmp_path / "worker.log", concurrency=2):
            yield
    else:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            yield


# -- the process that hands a slot off dies -----------------------------------------------


def test_a_releaser_killed_between_the_hand_off_and_its_publish_loses_nothing(
    gate_app: Celery, client: redis.Redis, tmp_path: Path
) -> None:
    """Proves: when the process that released a slot dies after release.lua reserved the
    slot for the oldest parked run but before it published that run's message, the run is
    not lost and runs exactly once: the reservation lapses after ``claim_timeout`` and the
    worker's sweep hands the slot to the same run again and publishes it.

    The releaser is a real prefork pool process ending a bounded run; a ``before_task_publish``
    receiver stops its hand-off publish (the script call is done, the message not yet sent)
    and the test SIGKILLs it there.
    """
    sem = _holder(gate_app)
    env = {"CSEM_TEST_STALL_HANDOFF": "1"}
    with prefork_worker_process(gate_app, tmp_path / "w.log", concurrency=2, env=env) as worker:
        releaser = gate_app.tasks["csem.gate"].delay(0, hold=True)
        assert wait_for(lambda: _started(client) == [0], timeout=60)
        (parked,) = _park(gate_app, sem, (1,))
        client.set(GATE_OPEN, 1)  # run 0 ends: its release reserves the slot for run 1
        assert wait_for(lambda: client.get(STALLED_PUBLISH) is not None, timeout=60)
        pid = int(client.get(STALLED_PUBLISH))  # type: ignore[arg-type]
        assert pid in child_pids(worker.pid), "the stalled publisher is not a pool process"
        # The slot is reserved for run 1, and its message was never sent.
        assert client.zscore(redis_keys("semaphore", KEY).slots, f"~{parked.id}") is not None
        assert _started(client) == [0]
        os.kill(pid, signal.SIGKILL)
        assert parked.get(timeout=60) == 1
        assert wait_for(lambda: _drained(sem) and _broker_idle(client), timeout=30)
    # The worker is stopped: nothing can start run 1 again. Each body ran once.
    _check(client, releaser.id, parked.id)
    # A prefork pool process sends a run's release itself, before Celery stores its result
    # (heartbeat.INLINE): killed during it, run 0 is a lost run (WorkerLostError).
    assert releaser.state == "FAILURE"


# -- a worker dies with a hand-off ---------------------------------------------------------


def _strand_a_hand_off(
    app: Celery,
    sem: Semaphore,
    client: redis.Redis,
    tmp_path: Path,
    hold: bool = False,
    task: str = "csem.gate",
) -> Any:
    """Park ``task(1, hold)`` in a prefork worker, release the test's slot so the run is
    handed it while both pool processes are busy (its message is prefetched, not started),
    then SIGKILL the whole worker: the message is stranded, delivered and never acked.
    Returns the run's AsyncResult."""
    held = sem.acquire(KEY)
    assert held is not None
    block = app.tasks["csem.block_until"]
    with prefork_worker_process(app, tmp_path / "a.log", concurrency=2) as worker_a:
        block.delay("test:unblock")  # one pool process busy; the other parks the run
        assert wait_for(lambda: client.llen(BLOCKING) == 1, timeout=60)
        (waiter,) = _park(app, sem, (1, hold), task=task)
        block.delay("test:unblock")  # now both are busy: a hand-off can only be prefetched
        assert wait_for(lambda: client.llen(BLOCKING) == 2, timeout=60)
        assert held.release()  # reserves the slot for the run and publishes its hand-off
        assert wait_for(
            lambda: queued(client) == 0 and set(unacked_task_ids(client)) == {waiter.id},
            timeout=60,
        )
        kill_worker(worker_a)
    assert _started(client) == []
    # Stranded with the dead worker (twice, had the reservation lapsed and the dead worker's
    # own sweep handed it out again before the kill).
    assert set(unacked_task_ids(client)) == {waiter.id}
    return waiter


@contextmanager
def _restoring_worker(url: str) -> Iterator[list[tuple[str, str]]]:
    """An in-process worker whose broker transport restores messages delivered more than a
    second ago and never acked (at its start, then every second), as any worker does once
    their visibility timeout passes. Yields the ``(task id, state)`` of each run that ended
    in this process meanwhile (``task_postrun``)."""
    seen: list[tuple[str, str]] = []

    def on_postrun(task_id: str = "", state: str = "", **_: Any) -> None:
        seen.append((task_id, state))

    options = {"visibility_timeout": 1, "unacked_restore_interval": 1,
               "unacked_restore_throttle": 1}  # fmt: skip
    app = add_room_fault_tasks(make_app(url, broker_transport_options=options))
    task_postrun.connect(on_postrun, weak=False)
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            yield seen
    finally:
        task_postrun.disconnect(on_postrun)
        app.close()


@pytest.mark.parametrize(
    ("task", "claim_lost"),
    [
        ("csem.gate", False),
        ("csem.gate_no_result", False),
        ("csem.gate", True),
    ],
)
def test_a_worker_killed_while_it_holds_a_hand_off_loses_nothing_and_runs_it_once(
    task: str, claim_lost: bool, gate_app: Celery, redis_server: RedisServer,
    client: redis.Redis, tmp_path: Path,
) -> None:  # fmt: skip
    """Proves: a whole worker SIGKILLed while it holds the message of a handed-off run
    (prefetched, not started; the slot reserved for it) loses nothing and runs nothing
    twice. Another worker's sweep hands the lapsed reservation to the same run again and
    starts it; when the broker later redelivers the dead worker's stranded message (its
    visibility timeout passed), that second delivery finds nothing to claim and ends
    quietly (state IGNORED), without running the body or touching the run's result. The
    same with a task that stores no result (``ignore_result=True``), and when the store
    lost its record of the claim (a restart) before the redelivery: the run's stored
    result says it ran.
    """
    sem = _holder(gate_app)
    waiter = _strand_a_hand_off(gate_app, sem, client, tmp_path, task=task)
    # Worker B (the broker's default visibility timeout: the stranded message stays out).
    with start_worker(gate_app, pool="threads", concurrency=2, perform_ping_check=False):
        assert wait_for(lambda: _started(client, completed=True) == [1], timeout=60)
        assert wait_for(lambda: _drained(sem), timeout=30)
    assert _started(client) == [1]
    if claim_lost:  # as a restart of a store apart from the broker would leave it
        assert client.delete(redis_keys("semaphore", KEY).claims) == 1
    # Worker C restores the stranded message: a second delivery of the same hand-off.
    with _restoring_worker(redis_server.url) as seen:
        assert wait_for(lambda: any(t == waiter.id for t, _ in seen), timeout=60)
        assert wait_for(lambda: _broker_idle(client) and _drained(sem), timeout=30)
    _check(client, waiter.id)  # the redelivered hand-off did not run the body again
    assert {state for task_id, state in seen if task_id == waiter.id} == {"IGNORED"}

    def missed() -> int:
        return sum(int(client.hget(k, "handoffs_missed") or 0)
                   for k in client.scan_iter(match="semaphore:stats:*"))  # fmt: skip

    # Worker C counted it: written within a second (FLUSH_DELAY), by a timer thread.
    assert wait_for(lambda: missed() == 1, timeout=15), missed()
    if task == "csem.gate":
        assert waiter.state == "SUCCESS"


def test_a_stranded_hand_off_redelivered_while_its_run_still_runs_is_not_run_again(
    gate_app: Celery, redis_server: RedisServer, client: redis.Redis, tmp_path: Path
) -> None:
    """Proves: as above, but the dead worker's stranded hand-off comes back while the run
    that the sweep's hand-off started is still in its body (it has no final state yet).
    That delivery (taken by either live worker) must neither run the body beside it nor
    park the run again to run it a second time after it ends: the body runs once, and
    nothing is left parked or held."""
    sem = _holder(gate_app)
    waiter = _strand_a_hand_off(gate_app, sem, client, tmp_path, hold=True)
    # Worker B: the sweep's hand-off starts the run, which holds its slot until the gate opens.
    with prefork_worker_process(gate_app, tmp_path / "b.log", concurrency=2):
        assert wait_for(lambda: _started(client) == [1], timeout=60)
        # Worker C restores the stranded message while the run is in its body; B or C takes
        # it (out of the broker's queue and unacked set: a pool process has accepted it).
        with _restoring_worker(redis_server.url):
            assert wait_for(lambda: _broker_idle(client), timeout=60)
            client.set(GATE_OPEN, 1)
            assert waiter.get(timeout=60) == 1
            assert wait_for(lambda: _drained(sem) and _broker_idle(client), timeout=30)
    # Both workers are stopped warm: whatever either had started has ended.
    _check(client, waiter.id)  # the stranded hand-off did not run the body again
    assert _drained(sem)


@pytest.mark.parametrize("acks", ["early", "late"])
def test_a_handed_off_run_whose_pool_process_is_killed(
    acks: str, gate_app: Celery, client: redis.Redis, tmp_path: Path
) -> None:
    """Proves, for a run started by a hand-off whose pool process is SIGKILLed while its body
    runs (it holds the claimed slot), that its slot is not leaked (the next parked run gets
    it, and the count returns to 0) and that the run ends as Celery's delivery settings say:

    * acks early (Celery's default): the run fails with WorkerLostError and is not run
      again; the worker's main process frees its slot at once and hands it to the next run.
    * acks late with reject_on_worker_lost (at least once): the message is requeued, and the
      run runs again to the end exactly once (its body started twice, finished once).
    """
    sem = _holder(gate_app)
    held = sem.acquire(KEY)
    assert held is not None
    env = {"CSEM_TEST_ACKS_LATE": "1"} if acks == "late" else {}
    with prefork_worker_process(gate_app, tmp_path / "w.log", concurrency=2, env=env) as worker:
        victim, following = _park(gate_app, sem, (1, True), (2,))
        assert held.release()  # hands the slot to the victim, which claims it and holds it
        assert wait_for(lambda: _started(client) == [1], timeout=60)
        [run] = History.load(client, BODIES).runs
        pid = run.pid
        assert pid in child_pids(worker.pid)
        os.kill(pid, signal.SIGKILL)
        client.set(GATE_OPEN, 1)  # a second run of the victim would not wait
        assert following.get(timeout=60) == 2
        if acks == "early":
            assert wait_for(lambda: victim.state == "FAILURE", timeout=30)
            assert "WorkerLostError" in repr(victim.result)
        else:
            try:  # it ran before the following run, had it run again: 15 s are plenty
                assert victim.get(timeout=15) == 1
            except CeleryTimeoutError:
                raise RunLost(f"the victim never finished: state {victim.state}") from None
        assert wait_for(lambda: _drained(sem) and _broker_idle(client), timeout=30)
    # The victim's body started once and never ended, plus (acks late) once more to the end.
    if acks == "early":
        _check(client, following.id, killed=(victim.id,))
    else:
        _check(client, following.id, victim.id, killed=(victim.id,))


# -- the store restarts with the room in it ------------------------------------------------


@contextlib.contextmanager
def _three_parked(
    redis_server: RedisServer, store: RedisServer
) -> Iterator[tuple[Semaphore, Slot, list[Any]]]:
    """Three runs (0, 1, 2) parked in ``KEY``'s room on ``store`` behind a slot held from
    this process, a threads worker of 2 running: the semaphore, the held slot, the runs."""
    app = add_room_fault_tasks(make_app(redis_server.url, semaphore_url=store.url))
    sem = _holder(app)
    held = sem.acquire(KEY)
    assert held is not None
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            yield sem, held, _park(app, sem, (0,), (1,), (2,))
    finally:
        app.close()


@pytest.mark.parametrize("persistence", ["appendonly", "snapshot"])
def test_a_room_survives_a_restart_of_a_persistent_store_and_drains(
    persistence: str, redis_server: RedisServer, client: redis.Redis
) -> None:
    """Proves: with persistence (``appendonly yes``, or an RDB snapshot taken after the runs
    parked), a restart of the semaphore store keeps the room: the same runs are parked in
    the same order afterwards, the holder's slot is still its own, and its release starts
    the room draining; each parked run then runs exactly once, one at a time."""
    args = ("--appendonly", "yes") if persistence == "appendonly" else ()
    with RedisServer(extra_args=args) as store, _three_parked(redis_server, store) as found:
        sem, held, parked = found
        if persistence == "snapshot":
            admin = store.client()
            assert admin.save()
            admin.close()
        store.restart()
        assert _room(sem) == [r.id for r in parked]
        assert held.release()  # still its slot: the restart did not take it away
        assert [r.get(timeout=60) for r in parked] == [0, 1, 2]
        assert wait_for(lambda: _drained(sem), timeout=30)
    _check(client, *(r.id for r in parked))
    assert _started(client) == [0, 1, 2]


def test_a_store_restored_from_an_older_snapshot_runs_no_served_run_again(
    redis_server: RedisServer, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Proves: a store restored from a snapshot taken while three runs were parked, after
    the three ran to completion, hands their slots out again (its room still has them), but
    no body runs a second time: each hand-off's run, parked in an older incarnation of the
    store, finds its result stored, gives the slot on and ends, said in a WARNING line; and
    the room drains. (Before, the three bodies ran again, said at INFO at most.)"""
    caplog.set_level(logging.INFO, logger="celery_semaphore")
    with RedisServer() as store, _three_parked(redis_server, store) as found:
        sem, held, parked = found
        assert store.client().save()  # the snapshot: three runs parked, the slot held
        assert held.release()
        assert [r.get(timeout=60) for r in parked] == [0, 1, 2]
        store.stop(kill=True)
        store.start()
        assert _room(sem) == [r.id for r in parked]
        # A worker's keeper sees the restart (a new marker) within its interval.
        marker = lambda: store.client().get("semaphore:incarnation") or b""  # noqa: E731
        before = marker()
        assert wait_for(lambda: marker() != before, timeout=30)
        # A process trusts the marker it read for a second (a documented window): this
        # worker's last claim before the restart may have read it just now.
        incarnation._cached.clear()
        assert sem.admin.force_release_all(KEY) == 1  # the snapshot's holder
        assert wait_for(lambda: len(_ran_before(caplog)) == 3 and _drained(sem), 60), (
            _ran_before(caplog), _room(sem), sem.count(KEY))  # fmt: skip
    _check(client, *(r.id for r in parked))
    assert sorted(_ran_before(caplog)) == sorted(r.id for r in parked)


def _ran_before(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The runs said (at WARNING) to have run already when a hand-off reached them."""
    said = [r for r in caplog.records if "reached a run that already ran" in str(r.msg)]
    return [str(r.args[0]).split("[")[1].split("]")[0] for r in said]  # type: ignore[index]


@pytest.mark.parametrize(
    "broker",
    [
        "redis",
        pytest.param("rabbitmq", marks=pytest.mark.skipif(
            not rabbitmq_up(), reason="no RabbitMQ on 127.0.0.1:5672")),
    ],
)  # fmt: skip
@pytest.mark.parametrize("persistence", ["none", "snapshot-then-kill", "appendonly"])
def test_a_restart_of_the_store_loses_no_parked_run(
    broker: str, persistence: str, redis_server: RedisServer, client: redis.Redis
) -> None:
    """Proves: a restart of the semaphore store loses no parked run while a worker lives,
    whatever the store kept. Without persistence the rooms are gone; after a SIGKILL the
    store comes back from a snapshot older than the last 21 parks; with an append-only file
    it comes back whole, under a new server run id. Each worker's journal finds the runs the
    store lost and sends them again, and sends nothing it still holds: every one of the 42
    runs runs exactly once, one at a time, counted by the bodies themselves."""
    extra = ("--appendonly", "yes") if persistence == "appendonly" else ()
    conf: dict[str, Any] = {}
    if broker == "rabbitmq":
        conf.update(broker_url=AMQP_URL, task_default_queue=f"csem-ledger-{uuid.uuid4().hex[:8]}")
    with RedisServer(extra_args=extra) as store:
        app = add_room_fault_tasks(make_app(redis_server.url, semaphore_url=store.url, **conf))
        sem = _holder(app)
        held = sem.acquire(KEY)
        assert held is not None
        try:
            with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
                runs = [app.tasks["csem.gate"].delay(n) for n in range(21)]
                assert wait_for(lambda: len(_room(sem)) == 21, timeout=60)
                if persistence == "snapshot-then-kill":
                    assert store.client().save()
                runs += [app.tasks["csem.gate"].delay(n) for n in range(21, 42)]
                assert wait_for(lambda: len(_room(sem)) == 42, timeout=60)
                store.stop(kill=persistence == "snapshot-then-kill")
                store.start()
                kept = persistence != "none"
                assert len(_room(sem)) == (21 if persistence == "snapshot-then-kill" else 42
                                           if kept else 0)  # fmt: skip
                # The holder's slot survived wherever the room did; a restart that lost it
                # lets the key's next run start at once.
                assert held.release() is kept
                assert sorted(r.get(timeout=120) for r in runs) == list(range(42))
                assert wait_for(lambda: _drained(sem), timeout=30)
        finally:
            if broker == "rabbitmq":
                default = app.conf.task_default_queue
                delete_queues(app, [default, default + SUFFIX])
            app.close()
    _check(client, *(r.id for r in runs))


def test_a_restart_while_a_run_parks_loses_it_not(
    redis_server: RedisServer, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves: a store that restarts empty while a run parks (when the parking process reads
    the store's incarnation for the run's journal entry) loses no run. Read after the park,
    the new store's incarnation would mark the run as served, and nothing would send it
    again; read before, the run parks in the new store, or is looked for and sent again."""
    from celery_semaphore.integration.waiting_room import incarnation, parking

    held: list[Any] = []  # the slot that keeps the key full in the store that parks the run

    def restart_then_read(client_: Any, prefix: str) -> str:
        if not held:
            store.restart()
            held.append(sem.acquire(KEY))
        return incarnation.incarnation(client_, prefix)

    with RedisServer() as store:
        app = add_room_fault_tasks(make_app(redis_server.url, semaphore_url=store.url))
        sem = _holder(app)
        assert sem.acquire(KEY) is not None
        incarnation._cached.clear()  # the parking process reads the marker afresh
        monkeypatch.setattr(parking, "incarnation", restart_then_read)
        try:
            with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
                run = app.tasks["csem.gate"].delay(7)
                assert wait_for(lambda: bool(held), timeout=60)
                assert held[0] is not None
                # Parked after the restart; a run parked before it would be lost (no room has it).
                assert wait_for(lambda: _room(sem) == [run.id], timeout=60)
                held[0].release()
                assert run.get(timeout=60) == 7
        finally:
            app.close()
    _check(client, run.id)


# -- parked runs that must not run ---------------------------------------------------------


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_parked_run_whose_expiry_passes_is_revoked_and_passes_its_hand_off_on(
    pool: str, gate_app: Celery, client: redis.Redis, tmp_path: Path
) -> None:
    """Proves: a parked run whose ``expires`` passes while it waits does not run its body.
    When a release hands it the slot, the worker that receives its message finds it
    expired and revokes it (state REVOKED, as Celery does for any expired message), takes it
    out of the room with its reservation, and hands the slot to the next parked run, which
    runs. Nothing is left held or parked."""
    sem = _holder(gate_app)
    held = sem.acquire(KEY)
    assert held is not None
    gate = gate_app.tasks["csem.gate"]
    with _worker(gate_app, pool, tmp_path):
        expires_at = time.time() + 5  # room to park it first, even on a slow machine
        doomed = gate.apply_async((1,), expires=5.0)
        assert wait_for(lambda: _room(sem) == [doomed.id], timeout=60)
        (kept,) = _park(gate_app, sem, (2,))
        assert time.time() < expires_at, "parked too late to test expiry in the room"
        assert wait_for(lambda: time.time() > expires_at + 1, timeout=30)  # the fault
        assert held.release()  # hands the slot to the expired run, oldest in the room
        assert kept.get(timeout=60) == 2
        assert wait_for(lambda: doomed.state == "REVOKED", timeout=30)
        assert wait_for(lambda: _drained(sem) and _broker_idle(client), timeout=30)
    _check(client, kept.id)  # the doomed run never ran


def test_a_revoked_parked_run_leaves_the_room_in_a_prefork_worker(
    gate_app: Celery, client: redis.Redis, tmp_path: Path
) -> None:
    """Proves the revoke of a parked run with a prefork worker, whose path differs from an
    in-process worker's: the revoked-id set, the REVOKED verdict, the ``task_revoked``
    signal and the cancel (with the hand-off of the run's reservation to the next parked
    run, published from there) all happen in the worker's main process, which never runs a
    body. The revoked run never runs, leaves the room, and the next one runs."""
    sem = _holder(gate_app)
    held = sem.acquire(KEY)
    assert held is not None
    with prefork_worker_process(gate_app, tmp_path / "w.log", concurrency=2):
        doomed, kept = _park(gate_app, sem, (1,), (2,))
        # Wait for the worker's answer, so the revoke is known before the hand-off arrives.
        replies = gate_app.control.revoke(doomed.id, reply=True, timeout=10, limit=1)
        assert replies, "the worker did not answer the revoke"
        assert held.release()  # hands the slot to the revoked run, oldest in the room
        assert kept.get(timeout=60) == 2
        assert wait_for(lambda: doomed.state == "REVOKED", timeout=30)
        assert wait_for(lambda: _drained(sem) and _broker_idle(client), timeout=30)
    _check(client, kept.id)  # the doomed run never ran


@pytest.mark.parametrize("track_started", [False, True])
def test_a_revoked_run_the_sweep_takes_out_of_the_room_is_revoked_for_its_caller(
    track_started: bool, redis_server: RedisServer, client: redis.Redis
) -> None:
    """Proves: a parked run revoked while no message of it reaches a worker (its slot never
    frees) is taken out of the room by a sweep and stored REVOKED, so ``get()`` raises
    ``TaskRevokedError`` instead of waiting for ever. With ``task_track_started`` the parked
    run is STARTED, which Celery's own revoke leaves alone (it was started somewhere); before
    5.7 Celery's revoke stores nothing at all. The run parked behind it is left as it was,
    and runs once the slot frees."""
    app = add_room_fault_tasks(make_app(redis_server.url, task_track_started=track_started))
    sem = _holder(app)
    held = sem.acquire(KEY)
    assert held is not None
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        doomed, kept = _park(app, sem, (1,), (2,))
        assert doomed.state == ("STARTED" if track_started else "PENDING")
        doomed.revoke()
        assert wait_for(lambda: _room(sem) == [kept.id], timeout=30), _room(sem)
        with pytest.raises(TaskRevokedError, match="revoked"):
            doomed.get(timeout=30)
        assert kept.state == ("STARTED" if track_started else "PENDING")
        assert held.release()
        assert kept.get(timeout=60) == 2
        assert wait_for(lambda: _drained(sem) and _broker_idle(client), timeout=30)
    _check(client, kept.id)  # the doomed run never ran
    app.close()


@pytest.mark.parametrize("queue_timeout", [None, 60.0])
def test_an_expired_parked_run_leaves_the_room_at_the_next_sweep_and_is_revoked(
    queue_timeout: float | None, redis_server: RedisServer, client: redis.Redis
) -> None:
    """Proves: a parked run whose ``expires`` passes leaves the room within a sweep (about
    2 s), while every slot is still held, and ends as Celery ends an expired task: REVOKED,
    ``get()`` raising ``TaskRevokedError('expired')``. So it no longer counts toward
    ``max_queued`` (1 here): a fresh run parks instead of being refused. With a
    ``queue_timeout`` far off, the expiry still comes first, and the run is not failed as a
    run past its wait budget."""
    app = add_room_fault_tasks(
        make_app(redis_server.url, semaphore_max_queued=1, semaphore_queue_timeout=queue_timeout)
    )
    sem = _holder(app)
    held = sem.acquire(KEY)
    assert held is not None
    gate = app.tasks["csem.gate"]
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        doomed = gate.apply_async((1,), expires=3.0)
        assert wait_for(lambda: _room(sem) == [doomed.id], timeout=30)
        with pytest.raises(TaskRevokedError, match="expired"):
            doomed.get(timeout=30)
        assert _room(sem) == []
        (fresh,) = _park(app, sem, (2,))  # max_queued=1: refused while the expired run stayed
        assert held.release()
        assert fresh.get(timeout=60) == 2
        assert wait_for(lambda: _drained(sem) and _broker_idle(client), timeout=30)
    _check(client, fresh.id)  # the expired run never ran
    app.close()
