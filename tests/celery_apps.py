"""A Celery app with bounded tasks, shared by in-process and subprocess workers in the tests.

Bounded bodies record their runs in the history :data:`BODIES` (tests/history.py) through a
Redis client of their own, so the tests judge concurrency and runs without the library.
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import signal
import tempfile
import time
import weakref
from typing import Any

import redis
from celery import Celery

from celery_semaphore import SemaphoreTask, bounded, current_slot
from celery_semaphore.core.group import SlotGroup

from . import history
from .history import BODIES

# Celery's settings for not losing a task whose pool process is killed: the message is
# acknowledged only when the run ends, requeued if its process dies, and redelivered if a
# worker lost it (a short visibility timeout suits the soak's short bodies and countdowns).
# A worker killed whole leaves its messages unacknowledged: they come back once the timeout
# has passed, at the next look, which kombu 5.7 takes every 100 s unless told otherwise.
AT_LEAST_ONCE: dict[str, Any] = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "broker_transport_options": {
        "visibility_timeout": 20,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
}


#: Every app :func:`make_app` made, for the tests' teardown (conftest.py).
MADE: weakref.WeakSet[Celery] = weakref.WeakSet()


def journal_dir() -> str:
    """The journals of this test's workers, out of the user's state directory: one directory
    that the test's processes share (a worker started later finds the journal of one that
    was killed, as on a host), and no other test's (whose stores had the same address: the
    shared server, or a port used again), which would send their parked runs here."""
    session = os.environ.setdefault("CSEM_TEST_SESSION", f"{os.getpid()}-{time.time_ns()}")
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]  # less "(call)"
    name = hashlib.sha256(f"{session}\n{test}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"csem-journal-{name}")


def make_app(redis_url: str, broker_url: str | None = None, **conf: Any) -> Celery:
    app = Celery("csem_tests", broker=broker_url or redis_url, backend=redis_url,
                 set_as_current=False)  # fmt: skip
    app.conf.update(
        {
            "semaphore_url": redis_url,
            "semaphore_shed_countdown": 0.05,
            "semaphore_shed_max_countdown": 0.3,
            "broker_connection_retry_on_startup": True,
            "worker_hijack_root_logger": False,
            "result_backend_max_retries": 2,
            "semaphore_journal": journal_dir(),
            **conf,
        }
    )
    MADE.add(app)
    recorder = redis.Redis.from_url(redis_url)

    @app.task(base=SemaphoreTask, semaphore="provider", limit=3, bind=True, max_retries=0,
              on_full="retry", shared=False, name="csem.provider_call")  # fmt: skip
    def provider_call(self: Any, n: int, duration: float = 0.1) -> dict[str, Any]:
        with history.run(recorder, BODIES, "provider"):
            time.sleep(duration)
        headers = self.request.headers or {}
        return {"n": n, "retries": self.request.retries, "sheds": headers.get("semaphore_sheds")}

    @app.task(base=SemaphoreTask, semaphore="tenant:{tenant_id}", limit=1,
              shared=False, name="csem.per_tenant")  # fmt: skip
    def per_tenant(tenant_id: str, duration: float = 0.1) -> str:
        with history.run(recorder, BODIES, f"tenant:{tenant_id}"):
            time.sleep(duration)
        return tenant_id

    @app.task(shared=False, name="csem.legacy")
    @bounded("legacy", 2)
    def legacy(n: int, duration: float = 0.05) -> int:
        with history.run(recorder, BODIES, "legacy"):
            time.sleep(duration)
        return n

    @app.task(shared=False, name="csem.total")
    def total(values: list[str]) -> list[str]:
        """An unbounded chord callback."""
        return sorted(values)

    @app.task(shared=False, name="csem.now")
    def now() -> float:
        """An unbounded task that answers when its body started (epoch seconds)."""
        return time.time()

    @app.task(base=SemaphoreTask, semaphore="auto", limit=1, autoretry_for=(ConnectionError,),
              bind=True, max_retries=0, on_full="retry", shared=False,
              name="csem.autoretry")  # fmt: skip
    def autoretry(self: Any, duration: float) -> dict[str, Any]:
        with history.run(recorder, BODIES, "auto"):
            time.sleep(duration)
        return {"sheds": (self.request.headers or {}).get("semaphore_sheds")}

    @app.task(base=SemaphoreTask, semaphore="boom", limit=1, shared=False, name="csem.failing")
    def failing() -> None:
        raise ValueError("the body failed")

    @app.task(base=SemaphoreTask, semaphore="again", limit=1, bind=True, max_retries=2,
              shared=False, name="csem.self_retry")  # fmt: skip
    def self_retry(self: Any) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=0.05)
        return int(self.request.retries)

    def hold_until_lost(key: str) -> str:
        """Records its start, then holds its slot until it is reported lost (at most 20 s)."""
        slot = current_slot()
        assert slot is not None
        with history.run(recorder, BODIES, key, slot=slot, mark_start=True):
            if not slot.lost.wait(20):
                return "never lost"
        return "body finished"

    @app.task(base=SemaphoreTask, semaphore="lost-raise", limit=1, lease=2.0, heartbeat=0.1,
              shared=False, name="csem.lost_raise")  # fmt: skip
    def lost_raise() -> str:
        return hold_until_lost("lost-raise")

    @app.task(base=SemaphoreTask, semaphore="lost-retry", limit=1, lease=2.0, heartbeat=0.1,
              on_lease_lost="retry", bind=True, shared=False, name="csem.lost_retry")  # fmt: skip
    def lost_retry(self: Any) -> str:
        if (self.request.headers or {}).get("semaphore_sheds"):
            with history.run(recorder, BODIES, "lost-retry"):
                return "second run"
        return hold_until_lost("lost-retry")

    @app.task(base=SemaphoreTask, semaphore="sleepy", limit=1, lease=30.0,
              shared=False, name="csem.sleepy")  # fmt: skip
    def sleepy(seconds: float) -> str:
        slot = current_slot()
        assert slot is not None
        with history.run(recorder, BODIES, "sleepy", slot=slot, mark_start=True):
            time.sleep(seconds)
        return "woke"

    @app.task(base=SemaphoreTask, semaphore="paused-release", limit=4, lease=60.0,
              shared=False, name="csem.pause_writes_then_end")  # fmt: skip
    def pause_writes_then_end(ms: int) -> int:
        """Ends with the semaphore's store refusing writes (scripts too) for ``ms``: its
        release, sent after the body, cannot have reached the store when the run is over
        (the result goes to another server: CSEM_TEST_SEMAPHORE_URL)."""
        store = redis.Redis.from_url(app.conf.semaphore_url)
        store.execute_command("CLIENT", "PAUSE", ms, "WRITE")
        store.close()
        return os.getpid()

    @app.task(base=SemaphoreTask, semaphore="long", limit=1, lease=1.0, shared=False,
              name="csem.long_body")  # fmt: skip
    def long_body(seconds: float) -> str:
        slot = current_slot()
        assert slot is not None
        with history.run(recorder, BODIES, "long", slot=slot, mark_start=True):
            time.sleep(seconds)
        return "lost" if slot.lost.is_set() else "kept"

    @app.task(base=SemaphoreTask, semaphore="held", limit=2, shared=False, name="csem.hold_until")
    def hold_until(flag: str) -> str:
        """Holds its slot until the test sets ``flag`` in Redis (at most 60 s)."""
        recorder.rpush("test:holding", flag)
        deadline = time.monotonic() + 60
        while not recorder.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.02)
        return flag

    @app.task(base=SemaphoreTask, semaphore="queued", limit=3, on_full="queue", claim_timeout=5.0,
              shared=False, name="csem.queued")  # fmt: skip
    def queued(n: int, duration: float = 0.1) -> int:
        with history.run(recorder, BODIES, "queued", data={"n": n}):
            time.sleep(duration)
        return n

    @app.task(base=SemaphoreTask, semaphore="queued", limit=3, on_full="queue", queue_timeout=0.5,
              shared=False, name="csem.queued_budget")  # fmt: skip
    def queued_budget(n: int) -> int:
        with history.run(recorder, BODIES, "queued", data={"n": n}):
            return n

    @app.task(base=SemaphoreTask, semaphore="queued", limit=3, on_full="wait", wait_timeout=30.0,
              shared=False, name="csem.waits")  # fmt: skip
    def waits(n: int) -> int:
        with history.run(recorder, BODIES, "queued", data={"n": n}):
            return n

    @app.task(base=SemaphoreTask, semaphore="queued", limit=3, on_full="wait", wait_timeout=0.2,
              shared=False, name="csem.waits_briefly")  # fmt: skip
    def waits_briefly(n: int) -> int:
        with history.run(recorder, BODIES, "queued", data={"n": n}):
            return n

    @app.task(base=SemaphoreTask, semaphore="queued", limit=3, on_full="queue", bind=True,
              max_retries=1, shared=False, name="csem.queued_retry")  # fmt: skip
    def queued_retry(self: Any) -> int:
        """Started by a hand-off, asks Celery for one retry, then succeeds."""
        if self.request.retries == 0:
            raise self.retry(countdown=0.05)
        return int(self.request.retries)

    @app.task(base=SemaphoreTask, semaphore="room:{key}", limit=2, on_full="queue",
              claim_timeout=60.0, bind=True, shared=False, name="csem.room_step")  # fmt: skip
    def room_step(
        self: Any, value: int, step: int = 0, key: str = "compat", duration: float = 0.05
    ) -> int:
        """A waiting-room task on key ``room:<key>`` (limit 2): returns ``value + step`` (a
        chain passes the previous link's result as ``value``). Each run records itself under
        its key with its ``value``, ``step`` and whether its message carried the hand-off
        header (``handoff``). The long claim_timeout keeps a lapsed reservation (a hand-off
        nobody published) from being rescued by a sweep within a test's timeouts."""
        handoff = (self.request.headers or {}).get("semaphore_handoff") is not None
        data = {"value": value, "step": step, "handoff": handoff}
        with history.run(recorder, BODIES, f"room:{key}", data=data):
            time.sleep(duration)
        return value + step

    @app.task(shared=False, name="csem.room_collect")
    def room_collect(values: list[int], key: str) -> list[int]:
        """An unbounded chord callback; each run records itself under key ``collect:<key>``,
        with the ``values`` it was given."""
        with history.run(recorder, BODIES, f"collect:{key}", data={"values": values}):
            return sorted(values)

    return app


# The module-level app for `celery -A tests.celery_apps worker`.
if "CSEM_TEST_REDIS_URL" in os.environ:
    _extra: dict[str, Any] = {}
    if "CSEM_TEST_SEMAPHORE_URL" in os.environ:
        _extra["semaphore_url"] = os.environ["CSEM_TEST_SEMAPHORE_URL"]
    if os.environ.get("CSEM_TEST_ACKS_LATE"):
        _extra.update(AT_LEAST_ONCE)
    if "CSEM_TEST_SWEEP_INTERVAL" in os.environ:
        _extra["semaphore_sweep_interval"] = float(os.environ["CSEM_TEST_SWEEP_INTERVAL"])
    if "CSEM_TEST_MAX_TASKS_PER_CHILD" in os.environ:
        _extra["worker_max_tasks_per_child"] = int(os.environ["CSEM_TEST_MAX_TASKS_PER_CHILD"])
    if os.environ.get("CSEM_TEST_POOL_RESTARTS"):
        _extra["worker_pool_restarts"] = True
    if "CSEM_TEST_DEFAULT_QUEUE" in os.environ:
        _extra["task_default_queue"] = os.environ["CSEM_TEST_DEFAULT_QUEUE"]
    app = make_app(
        os.environ["CSEM_TEST_REDIS_URL"], os.environ.get("CSEM_TEST_BROKER_URL"), **_extra
    )


# The waiting room's fault tests (tests/test_room_faults.py).

GATE_OPEN = "test:gate:open"
"""While this key is missing, ``csem.gate`` runs asked to ``hold`` keep their slot."""
STALLED_PUBLISH = "test:stalled-publish"
"""The pid of the process whose hand-off publish ``stall_first_handoff_publish`` stopped."""
BLOCKING = "test:blocking"
"""The pids of the ``csem.block_until`` runs that started."""


def add_room_fault_tasks(app: Celery) -> Celery:
    """Add the waiting room's fault-test tasks to ``app`` (one of :func:`make_app`'s):

    * ``csem.gate(n, hold=False)``: key "gate", limit 1, ``on_full="queue"``, lease 2 s,
      ``claim_timeout`` 4 s (what a test does while a hand-off is reserved has seconds of
      margin). Each run records its start in the history :data:`BODIES` (key "gate", data
      ``n``), holds its slot while ``hold`` until the test sets :data:`GATE_OPEN` (at most
      60 s), then records its end: a body killed midway is a run that never ended.
      ``csem.gate_no_result`` is the same with ``ignore_result=True``.
    * ``csem.block_until(flag)``: unbounded; records its pid under :data:`BLOCKING` and
      keeps its pool process busy until the test sets ``flag`` (at most 60 s).
    """
    recorder = redis.Redis.from_url(app.conf.result_backend)

    def gate(n: int, hold: bool = False) -> int:
        slot = current_slot()
        with history.run(recorder, BODIES, "gate", slot=slot, mark_start=True, data={"n": n}):
            deadline = time.monotonic() + 60
            while hold and not recorder.exists(GATE_OPEN) and time.monotonic() < deadline:
                time.sleep(0.02)
        return n

    for name, ignore_result in [("csem.gate", False), ("csem.gate_no_result", True)]:
        app.task(base=SemaphoreTask, semaphore="gate", limit=1, lease=2.0, on_full="queue",
                 claim_timeout=4.0, ignore_result=ignore_result, shared=False,
                 name=name)(gate)  # fmt: skip

    @app.task(shared=False, name="csem.block_until")
    def block_until(flag: str) -> str:
        recorder.rpush(BLOCKING, os.getpid())
        deadline = time.monotonic() + 60
        while not recorder.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.02)
        return flag

    return app


# The soak's tasks (tests/test_soak.py).

SOAK_LIMITS = {"soak:provider": 6, "soak:tenant": 3, "soak:shed": 3}
"""The soak's keys and their limits in the code: a provider's pool, a tenant's share of it,
and a key whose runs shed instead of waiting."""
SOAK_LEASE = 2.0
"""The soak's lease: a frozen store lets it lapse within seconds."""
SOAK_CLAIM_TIMEOUT = 2.0
"""How long a hand-off's slot waits for its run in the soak: one lost in a killed worker
is handed out again within seconds."""


def add_soak_tasks(app: Celery) -> Celery:
    """Add the soak's tasks to ``app`` (one of :func:`make_app`'s). Each takes ``(n, seconds)``
    and sleeps ``seconds`` in its body, which records its start and end in the history
    :data:`BODIES` (with whether its slot was lost, and ``admitted``: when the store granted
    the slot, epoch seconds by its clock); a body killed midway is a run that never ended.
    Lease :data:`SOAK_LEASE`, heartbeat 0.2 s, ``claim_timeout`` :data:`SOAK_CLAIM_TIMEOUT`:

    * ``csem.soak_one``: key "soak:provider", in the waiting room.
    * ``csem.soak_both``: keys "soak:provider" and "soak:tenant" at once, in the room.
    * ``csem.soak_heavy(n, seconds, units)``: ``units`` of "soak:provider", in the room.
    * ``csem.soak_shed``: key "soak:shed", ``on_full="retry"`` (shed with a countdown).
    """
    recorder = redis.Redis.from_url(app.conf.result_backend)
    provider, tenant, shedding = SOAK_LIMITS
    options: dict[str, Any] = {"base": SemaphoreTask, "lease": SOAK_LEASE, "heartbeat": 0.2,
                               "claim_timeout": SOAK_CLAIM_TIMEOUT, "shared": False}  # fmt: skip

    def body(keys: list[str], seconds: float, units: int = 1) -> None:
        slot = current_slot()
        assert slot is not None
        first = slot.slots[0] if isinstance(slot, SlotGroup) else slot
        data = {"admitted": first.acquired_at}
        with history.run(recorder, BODIES, keys, weight=units, slot=slot, mark_start=True,
                         data=data):  # fmt: skip
            time.sleep(seconds)

    @app.task(semaphore=provider, limit=SOAK_LIMITS[provider], on_full="queue",
              name="csem.soak_one", **options)  # fmt: skip
    def soak_one(n: int, seconds: float) -> int:
        body([provider], seconds)
        return n

    @app.task(semaphore=[(provider, SOAK_LIMITS[provider]), (tenant, SOAK_LIMITS[tenant])],
              on_full="queue", name="csem.soak_both", **options)  # fmt: skip
    def soak_both(n: int, seconds: float) -> int:
        body([provider, tenant], seconds)
        return n

    @app.task(semaphore=provider, limit=SOAK_LIMITS[provider], on_full="queue",
              weight=lambda n, seconds, units: units, name="csem.soak_heavy",
              **options)  # fmt: skip
    def soak_heavy(n: int, seconds: float, units: int) -> int:
        body([provider], seconds, units)
        return n

    @app.task(semaphore=shedding, limit=SOAK_LIMITS[shedding], on_full="retry",
              name="csem.soak_shed", **options)  # fmt: skip
    def soak_shed(n: int, seconds: float) -> int:
        body([shedding], seconds)
        return n

    return app


def stall_first_handoff_publish(redis_url: str) -> None:
    """Stop the first hand-off publish of any process that imported this (a worker's main
    process or pool children) just before it reaches the broker: the process that wins
    :data:`STALLED_PUBLISH` in Redis writes its pid there and waits (60 s at most) for the
    test to SIGKILL it. Later hand-offs, in any process, are published as usual."""
    from celery.signals import before_task_publish

    recorder = redis.Redis.from_url(redis_url)

    def stall(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if (headers or {}).get("semaphore_handoff") is None:
            return
        if not recorder.set(STALLED_PUBLISH, os.getpid(), nx=True):
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)

    before_task_publish.connect(stall, weak=False)


if "CSEM_TEST_REDIS_URL" in os.environ:
    add_room_fault_tasks(app)
    add_soak_tasks(app)
    if os.environ.get("CSEM_TEST_STALL_HANDOFF"):
        stall_first_handoff_publish(os.environ["CSEM_TEST_REDIS_URL"])
    if os.environ.get("CSEM_TEST_STACKS_ON_SIGUSR2"):
        # A worker that will not stop: every process of it can be made to print its stacks.
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    if os.environ.get("CSEM_TEST_RECORD_DELIVERIES"):
        # The soak kills pool processes: the checker must know what each was running.
        history.record_deliveries(
            redis.Redis.from_url(os.environ["CSEM_TEST_REDIS_URL"]), BODIES, "csem.soak"
        )
