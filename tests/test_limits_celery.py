"""Limits as data with a real worker: semaphores declared once in ``app.conf.semaphores``, a
limit computed from the task's arguments (a callable or a mapping), and a live limit raised
while runs wait in the room. Concurrency is judged from the bodies' own records."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from click.testing import CliRunner

from celery_semaphore import (
    Semaphore,
    SemaphoreTask,
    SemaphoreValidationError,
    bounded,
    current_slot,
)
from celery_semaphore.integration.settings import app_settings
from celery_semaphore.testing import RedisServer
from celery_semaphore.views.cli import semaphore as semaphore_cli

from . import history
from .celery_apps import make_app
from .helpers import wait_for
from .history import BODIES, History

TENANT_LIMITS = {"a": 1, "b": 3}
GATE = "test:limits:gate"
FAIL = "test:limits:fail"
"""While this key exists, ``lim.flaky`` runs with n == 1 compute no valid limit."""
"""While this key is missing, the first ``lim.live`` run keeps its slot."""


def _limit_of(tenant: str, n: int) -> int:
    return TENANT_LIMITS[tenant]


@pytest.fixture
def data_app(redis_server: RedisServer) -> Iterator[Celery]:
    """An app with a declared semaphore and tasks whose limits come from data."""
    app = make_app(redis_server.url, semaphore_on_full="queue")
    app.conf.semaphores = {"declared": {"limit": 2, "lease": 9.0}}
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="declared", shared=False, name="lim.declared")
    def declared(n: int) -> float:
        slot = current_slot()
        assert slot is not None
        with history.run(recorder, BODIES, "declared"):
            time.sleep(0.1)
        return slot.lease

    @app.task(base=SemaphoreTask, semaphore="tenant:{tenant}", limit=_limit_of, shared=False,
              name="lim.computed")  # fmt: skip
    def computed(tenant: str, n: int) -> int:
        with history.run(recorder, BODIES, f"tenant:{tenant}"):
            time.sleep(0.1)
        return n

    @app.task(shared=False, name="lim.mapped")
    @bounded("plan:{plan}", {"plan:free": 1, "*": 2})
    def mapped(plan: str, n: int) -> int:
        with history.run(recorder, BODIES, f"plan:{plan}"):
            time.sleep(0.1)
        return n

    @app.task(shared=False, name="lim.strict_map")
    @bounded("plan:{plan}", {"plan:free": 1})
    def strict_map(plan: str) -> str:
        return plan

    @app.task(base=SemaphoreTask, semaphore="bad:{n}", limit=lambda n: n, shared=False,
              name="lim.bad_callable")  # fmt: skip
    def bad_callable(n: int) -> int:
        return n

    def flaky_limit(n: int) -> int:
        return 0 if n == 1 and recorder.exists(FAIL) else 1

    @app.task(base=SemaphoreTask, semaphore="flaky", limit=flaky_limit, shared=False,
              name="lim.flaky")  # fmt: skip
    def flaky(n: int) -> int:
        with history.run(recorder, BODIES, "flaky", mark_start=True, data={"n": n}):
            while n == 0 and not recorder.exists(GATE):
                time.sleep(0.02)
        return n

    @app.task(base=SemaphoreTask, semaphore="live", limit=1, shared=False, name="lim.live")
    def live(n: int) -> int:
        with history.run(recorder, BODIES, "live", mark_start=True, data={"n": n}):
            while n == 0 and not recorder.exists(GATE):  # the first run holds its slot
                time.sleep(0.02)
            time.sleep(0.2)
        return n

    yield app
    recorder.close()
    gc.collect()  # AsyncResults talk to the backend in __del__: collect them while it is up
    app.close()


def test_declared_semaphore_limits_and_options_apply_to_the_tasks_that_name_it(
    data_app: Celery, client: redis.Redis
) -> None:
    with start_worker(data_app, pool="threads", concurrency=6, perform_ping_check=False):
        results = [data_app.tasks["lim.declared"].delay(n) for n in range(8)]
        leases = [r.get(timeout=60) for r in results]
    assert leases == [9.0] * 8  # the declaration's lease
    History.load(client, BODIES).assert_ok({"declared": 2}, tasks=[r.id for r in results])


def test_limits_computed_from_the_arguments_bound_each_key_on_its_own(
    data_app: Celery, client: redis.Redis
) -> None:
    computed, mapped = data_app.tasks["lim.computed"], data_app.tasks["lim.mapped"]
    with start_worker(data_app, pool="threads", concurrency=8, perform_ping_check=False):
        results = [computed.delay(t, n) for n in range(6) for t in ("a", "b")]
        results += [mapped.delay(p, n) for n in range(6) for p in ("free", "pro")]
        for r in results:
            r.get(timeout=60)
    runs = History.load(client, BODIES)
    report = runs.assert_ok(
        {"tenant:a": 1, "tenant:b": 3, "plan:free": 1, "plan:pro": 2},
        tasks=[r.id for r in results],
    )
    # Each key reached its own limit: the limits are not one shared number.
    assert report.peaks["tenant:b"] >= 2
    assert report.peaks["plan:pro"] == 2


def test_a_bad_computed_limit_fails_the_run_naming_the_key_and_writes_nothing(
    data_app: Celery, client: redis.Redis
) -> None:
    with pytest.raises(SemaphoreValidationError, match="'bad:0'"):
        data_app.tasks["lim.bad_callable"].apply(args=(0,)).get()
    with pytest.raises(SemaphoreValidationError, match="no entry for semaphore key 'plan:pro'"):
        data_app.tasks["lim.strict_map"].apply(args=("pro",)).get()
    assert data_app.tasks["lim.strict_map"].apply(args=("free",)).get() == "free"
    assert client.keys("semaphore:{bad*") == []
    assert client.keys("semaphore:{plan:pro}*") == []


def test_a_live_limit_raised_from_the_command_line_starts_parked_runs_at_once(
    data_app: Celery, client: redis.Redis
) -> None:
    """While the one slot stays held, raising the limit to 3 starts two parked runs: no
    release is needed to hand the new capacity out."""
    sem = Semaphore(data_app.conf.semaphore_url, limit=1)
    task = data_app.tasks["lim.live"]
    with start_worker(data_app, pool="threads", concurrency=6, perform_ping_check=False):
        first = task.delay(0)
        assert wait_for(lambda: sem.count("live") == 1, timeout=30)
        results = [first, *(task.delay(n) for n in range(1, 6))]
        assert wait_for(lambda: len(sem.room.waiters("live")) == 5, timeout=30)
        raised_at = time.monotonic()
        ctx = type("Ctx", (), {"app": data_app})()
        out = CliRunner().invoke(semaphore_cli, ["set-limit", "live", "3"], obj=ctx)
        assert out.exit_code == 0, out.output

        def started_since_raise() -> int:
            return sum(r.start > raised_at for r in History.load(client, BODIES).runs)

        assert wait_for(lambda: started_since_raise() == 2, timeout=30)
        assert first.state == "PENDING" or not first.ready()  # the first still holds
        client.set(GATE, 1)
        for r in results:
            r.get(timeout=60)
    runs = History.load(client, BODIES)
    report = runs.assert_ok({"live": [(0.0, 1), (raised_at, 3)]}, tasks=[r.id for r in results])
    assert report.peaks["live"] == 3


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ({"x": {"limt": 2}}, "did you mean 'limit'"),
        ({"x": {"limit": 0}}, r"app.conf.semaphores\['x'\]: limit must be"),
        ({"x": {"limit": 2, "on_full": "block"}}, "on_full must be one of"),
        ({"x": 5}, "must be a mapping of options"),
        (["x"], "must map names to options"),
        ({"x": {"semaphore": "y"}}, "unknown"),
    ],
)
def test_bad_declarations_are_refused_naming_them(
    redis_server: RedisServer, declared: Any, message: str
) -> None:
    app = make_app(redis_server.url)
    app.conf.semaphores = declared
    with pytest.raises(SemaphoreValidationError, match=message):
        app_settings(app)
    app.close()


def test_a_task_with_no_limit_and_no_declaration_fails_when_bound(
    redis_server: RedisServer,
) -> None:
    app = Celery("nolimit", broker=redis_server.url, set_as_current=False)
    app.conf.semaphores = {"other": {"limit": 2}}
    with pytest.raises(SemaphoreValidationError, match="limit is required"):

        @app.task(base=SemaphoreTask, semaphore="undeclared", shared=False, name="n.t")
        def t() -> None: ...

        app.finalize()
    with pytest.raises(SemaphoreValidationError, match="also give app="):
        bounded("undeclared")(lambda: None)


def test_a_handed_off_run_whose_limit_fails_leaves_the_room_and_passes_its_slot_on(
    data_app: Celery, client: redis.Redis
) -> None:
    """The run fails, is not handed a slot again, and the next run gets it at once."""
    sem = Semaphore(data_app.conf.semaphore_url, limit=1)
    task = data_app.tasks["lim.flaky"]
    with start_worker(data_app, pool="threads", concurrency=4, perform_ping_check=False):
        first = task.delay(0)
        assert wait_for(lambda: sem.count("flaky") == 1, timeout=30)
        failing, last = task.delay(1), task.delay(2)
        assert wait_for(lambda: len(sem.room.waiters("flaky")) == 2, timeout=30)
        client.set(FAIL, 1)
        client.set(GATE, 1)  # the first ends: its slot goes to the failing run
        assert last.get(timeout=20) == 2  # well before the 30 s claim timeout
        with pytest.raises(SemaphoreValidationError, match="'flaky'"):
            failing.get(timeout=20)
        assert first.get(timeout=20) == 0
        assert wait_for(lambda: sem.count("flaky") == 0 and not sem.room.waiters("flaky"), 10)
    History.load(client, BODIES).assert_ok({"flaky": 1}, tasks=[first.id, last.id])


def test_a_heartbeat_is_judged_against_the_lease_that_applies(redis_server: RedisServer) -> None:
    """A declared heartbeat under the app's lease, a task's heartbeat under a declared lease:
    both fine when bound; a task's heartbeat above half a declared lease is refused."""
    app = Celery("timing", broker=redis_server.url, set_as_current=False)
    app.conf.semaphore_lease = 120.0
    app.conf.semaphores = {"a": {"limit": 1, "heartbeat": 40.0}, "b": {"limit": 1, "lease": 120.0},
                           "c": {"limit": 1, "lease": 10.0}}  # fmt: skip

    def body() -> None: ...

    app.task(base=SemaphoreTask, semaphore="a", shared=False, name="t.a")(body)
    app.task(base=SemaphoreTask, semaphore="b", heartbeat=40.0, shared=False, name="t.b")(body)
    app.finalize()
    with pytest.raises(SemaphoreValidationError, match="heartbeat"):
        app.task(base=SemaphoreTask, semaphore="c", heartbeat=40.0, shared=False, name="t.c")(body)
