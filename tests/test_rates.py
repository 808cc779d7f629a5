"""Start rates, on a real Redis: the waiting room hands each run its slot for the instant its
rates allow (GCRA on the server's clock), the run's message is published to start then, and
a run that comes early waits for it; bad rates are refused before anything is written."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from click.testing import CliRunner
from kombu.serialization import dumps

from celery_semaphore import (
    Semaphore,
    SemaphoreNotAcquiredError,
    SemaphoreTask,
    SemaphoreValidationError,
    Slot,
    bounded,
)
from celery_semaphore.core.names import redis_keys
from celery_semaphore.core.rates import Rate
from celery_semaphore.core.replies import Handoff
from celery_semaphore.integration.waiting_room.handoffs import DUE_HEADER, publisher_for
from celery_semaphore.testing import RedisServer
from celery_semaphore.views.cli import semaphore as semaphore_cli

from . import history
from .celery_apps import make_app
from .helpers import AMQP_URL, Published, delete_queues, rabbitmq_up, wait_for
from .history import BODIES, History


def _park_five(url: str, rates: object) -> list[int]:
    """Park five waiters of "k" (limit 5) one after another; the first takes a slot (its
    rate allows it). The start instant of each other's hand-off, in ms after the first's
    slot, all by the store's clock (this process's would measure its own delays too)."""
    published = Published()
    sem = Semaphore(url, limit=5, on_handoff=published)
    first = sem.room.park("k", "w0", b"p", rates=rates)  # type: ignore[arg-type]
    for n in range(1, 5):
        sem.room.park("k", f"w{n}", b"p", rates=rates)  # type: ignore[arg-type]
    assert isinstance(first, Slot)
    sem.client.close()
    return [h.start_ms - round(first.acquired_at * 1000) for h in published.made]


def test_a_rate_spaces_the_starts_it_hands_out(redis_server: RedisServer) -> None:
    # One start every 500 ms: each run is handed its slot for its own instant, one interval
    # after the one before, though every slot but one is free (the parks take far less).
    assert _park_five(redis_server.url, "2/s") == [500, 1000, 1500, 2000]


def test_a_burst_starts_at_once_then_the_rate_spaces_the_rest(redis_server: RedisServer) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=5, on_handoff=published)
    burst = Rate("2/s", burst=3)
    taken = [sem.room.park("k", f"w{n}", b"p", rates=burst) for n in range(5)]
    assert [isinstance(t, Slot) for t in taken] == [True, True, True, False, False]
    # Three at once drain the bucket: the fourth waits one interval, the fifth two.
    first = round(taken[0].acquired_at * 1000)  # type: ignore[union-attr]
    assert [h.waiter for h in published.made] == ["w3", "w4"]
    assert [h.start_ms - first for h in published.made] == [500, 1000]
    sem.client.close()


def test_units_of_a_tokens_rate_come_from_the_run(redis_server: RedisServer) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=5, on_handoff=published)
    tokens = Rate("10/s", name="tokens", burst=50)
    big = sem.room.park("k", "big", b"p", rates=tokens, units={"tokens": 50})
    assert isinstance(big, Slot)
    sem.room.park("k", "small", b"p", rates=tokens, units={"tokens": 5})
    # 50 tokens drained the bucket of 50: 5 more come back in 500 ms at 10/s, whatever the
    # size of the run before.
    (handoff,) = published.made
    assert handoff.start_ms - round(big.acquired_at * 1000) == 500, handoff
    sem.client.close()


def test_a_run_that_comes_early_waits_for_its_instant(redis_server: RedisServer) -> None:
    published = Published()
    sem = Semaphore(redis_server.url, limit=5, on_handoff=published)
    sem.room.park("k", "w0", b"p", rates="1/s")
    sem.room.park("k", "w1", b"p", rates="1/s")
    (handoff,) = published.made
    delay = handoff.start_ms / 1000 - time.time()
    assert delay > 0.3  # a second from the first slot, less the parks' own time
    started = time.monotonic()
    slot = sem.room.claim("k", "w1")  # at once, not at its instant: it waits there
    assert isinstance(slot, Slot)
    assert time.monotonic() - started > delay - 0.05
    sem.client.close()


def _tat(client: redis.Redis, limits: str) -> float:
    """The requests rate's TAT (epoch ms), stored with the interval it was reckoned under."""
    stored = client.hget(limits, "tat:requests") or b"0"
    return float(stored.split()[0])


def test_a_run_that_comes_late_for_its_instant_takes_a_new_one(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    # 20/s: an instant every 50 ms, and a run may start up to 25 ms after its own. w1 comes
    # later than that (its worker was busy): starting it then would put it beside w2's
    # instant, so it waits for the first instant after every one given out.
    published = Published()
    sem = Semaphore(redis_server.url, limit=5, on_handoff=published)
    for n in range(4):
        sem.room.park("k", f"w{n}", b"p", rates="20/s")
    w1, _, w3 = published.made
    assert wait_for(lambda: _store_ms(client) > w1.start_ms + 40, timeout=5.0)
    limits = redis_keys("semaphore", "k").limits
    last_given = _tat(client, limits)
    assert last_given == w3.start_ms + 50
    slot = sem.room.claim("k", "w1")
    assert isinstance(slot, Slot)
    assert slot.acquired_at * 1000 >= last_given - 1  # its start, by the store's clock
    assert _tat(client, limits) >= last_given + 50
    sem.client.close()


def _store_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


@pytest.mark.parametrize(
    ("rates", "units", "message"),
    [
        ("500/x", None, "like '10/s'"),
        ("0/m", None, "more than nothing"),
        (-5, None, "more than nothing"),
        ([Rate("10/s"), "20/s"], None, "name of its own"),
        (Rate("10/s", name="tokens", burst=50), {"tokens": 60}, "from 1 to the burst"),
        ("10/s", {"tokens": 5}, "units for no rate"),
        (None, {"tokens": 5}, "units given for no rate"),
    ],
    ids=repr,
)
def test_a_bad_rate_is_refused_before_anything_is_written(
    redis_server: RedisServer, rates: object, units: object, message: str
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    sem = Semaphore(client, limit=1)
    with pytest.raises(SemaphoreValidationError, match=message):
        sem.room.park("k", "w", b"p", rates=rates, units=units)  # type: ignore[arg-type]
    assert client.keys("*") == []
    client.close()


@pytest.mark.parametrize(
    "kwargs",
    [{"burst": -1}, {"burst": 0}, {"burst": True}, {"name": "two words"}, {"units": 0}],
    ids=repr,
)
def test_a_bad_rate_object_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(SemaphoreValidationError, match=r"rate '(10/s|requests)'"):
        Rate("10/s", **kwargs)  # type: ignore[arg-type]


def test_a_semaphore_with_a_rate_refuses_then_waits_for_it(redis_server: RedisServer) -> None:
    sem = Semaphore(redis_server.url, limit=5, rate="2/s")
    first = sem.acquire("k")
    assert first is not None
    assert sem.acquire("k") is None  # a slot is free, the rate's next unit is not
    started = time.monotonic()
    second = sem.acquire("k", wait=5.0)  # blocks until the rate allows it, not a release
    assert second is not None
    assert second.acquired_at - first.acquired_at >= 0.5 - 0.002
    assert time.monotonic() - started < 4.0
    tokens = Semaphore(redis_server.url, limit=5, rate=Rate("10/s", name="tokens", burst=5))
    with tokens.hold("t", units={"tokens": 5}):
        assert tokens.acquire("t", units={"tokens": 1}) is None  # the bucket is empty
    with pytest.raises(SemaphoreValidationError, match="units for no rate of the key"):
        sem.acquire("k", units={"tokens": 1})  # nothing is sent
    plain = Semaphore(redis_server.url, limit=5)
    with pytest.raises(SemaphoreValidationError, match="units given for no rate"):
        plain.acquire("p", units={"tokens": 1})
    assert plain.client.exists("semaphore:{p}") == 0
    plain.client.close()
    with pytest.raises(SemaphoreValidationError, match="from 1 to the burst"):
        tokens.acquire("t", units={"tokens": 6})
    sem.client.close()
    tokens.client.close()


def test_an_asyncio_semaphore_with_a_rate_waits_for_it(redis_server: RedisServer) -> None:
    from celery_semaphore.asyncio import AsyncSemaphore

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=5, rate="2/s") as sem:
            first = await sem.acquire("k")
            assert first is not None
            assert await sem.acquire("k") is None
            second = await sem.acquire("k", wait=5.0)
            assert second is not None
            assert second.acquired_at - first.acquired_at >= 0.5 - 0.002

    asyncio.run(main())


def test_a_plain_call_of_a_rated_function_is_held_to_the_rate(app: Celery) -> None:
    @bounded("rated-call", 5, rate="2/s", app=app)
    def call(n: int) -> int:
        return n

    @bounded("rated-call", 5, rate="2/s", app=app, retries=30, retry_delay=0.05)
    def patient(n: int) -> int:
        return n

    assert call(1) == 1
    with pytest.raises(SemaphoreNotAcquiredError):
        call(2)  # fails fast: the next unit is half a second away
    assert patient(3) == 3  # retries until the rate allows it

    tokens = Rate("10/s", name="tokens", burst=5, units=lambda n: n)

    @bounded("rated-tokens", 5, rate=tokens, app=app)
    def spend(n: int) -> int:
        return n

    assert spend(5) == 5  # the whole bucket: units from the call's own arguments
    with pytest.raises(SemaphoreNotAcquiredError):
        spend(1)


def test_a_rate_holds_a_worker_to_its_starts(
    redis_server: RedisServer, client: redis.Redis, app: Celery
) -> None:
    """Twenty runs of a task with rate 20/s and limit 5 on a threads worker: every run
    ends, never more than 5 at once, and their starts, by the bodies' own clocks, span at
    least 19 intervals of 50 ms (less a wide margin), never more than 21 in any second."""
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="rated", limit=5, rate="20/s", shared=False,
              name="rates.call")  # fmt: skip
    def call(n: int) -> int:
        with history.run(recorder, BODIES, "rated", data={"n": n}):
            pass
        return n

    sem = Semaphore(redis_server.url, limit=5, on_handoff=publisher_for(app))
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        results = [call.delay(n) for n in range(20)]
        assert sorted(r.get(timeout=60) for r in results) == list(range(20))
    runs = History.load(client, BODIES)
    runs.assert_ok({"rated": 5}, tasks=[r.id for r in results])
    starts = sorted(run.start for run in runs.runs)
    assert starts[-1] - starts[0] > 19 * 0.05 * 0.8, starts
    assert max(sum(1 for s in starts if t <= s < t + 1.0) for t in starts) <= 21
    assert sem.room.waiters("rated") == []
    recorder.close()


def test_a_rate_hand_off_held_past_the_brokers_visibility_timeout_runs_once(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    """A hand-off for a start rate's instant is published with that ETA; a Redis broker
    restores a message held unacked past its visibility timeout, so a copy of it comes while
    the first waits or runs (in a public report each body ran 2-3 times). Each body must run
    once: a copy finds the run its message started holding its slot, or ended."""
    # The broker looks for messages held past their visibility timeout every second (kombu's
    # default is every 10 s, or 100 s for kombu 5.6's throttled scan).
    options = {"visibility_timeout": 2, "unacked_restore_interval": 1,
               "unacked_restore_throttle": 1}  # fmt: skip
    app = make_app(redis_server.url, broker_transport_options=options)
    recorder = redis.Redis.from_url(redis_server.url)

    @app.task(base=SemaphoreTask, semaphore="vt", limit=5, rate="20/m", shared=False,
              name="rates.vt")  # fmt: skip
    def call(n: int) -> int:
        with history.run(recorder, BODIES, "vt", data={"n": n}):
            time.sleep(0.5)
        return n

    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        # Starts 3 s apart: hand-offs due at 3, 6 and 9 s, held unacked meanwhile, and
        # restored by the broker once held past 2 s.
        results = [call.delay(n) for n in range(4)]
        assert sorted(r.get(timeout=60) for r in results) == list(range(4))

        # Let the restored copies come and go: nothing left queued, unacked or running.
        def settled() -> bool:
            queues = ("celery", "celery.semaphore-handoffs", "unacked")
            return (
                not any(client.exists(q) for q in queues)
                and not History.load(client, BODIES).unfinished
            )

        settle = wait_for(settled, timeout=30)
    ran = sorted(run.data["n"] for run in History.load(client, BODIES).runs)
    assert settle, ran
    assert ran == [0, 1, 2, 3], ran
    recorder.close()
    app.close()


def test_the_rates_state_expires_but_an_operators_setting_beside_it_does_not(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    sem = Semaphore(redis_server.url, limit=2, on_handoff=Published())
    limits = redis_keys("semaphore", "k").limits
    assert isinstance(sem.room.park("k", "w0", b"p", rates="2/s"), Slot)
    assert 0 < client.pttl(limits) <= 1500  # one TAT, half a second ahead, and a margin
    sem.admin.set_limit("k", 1, by="ops")
    assert client.pttl(limits) == -1  # the live limit stays until it is cleared
    sem.room.park("k", "w1", b"p", rates="2/s")  # a rate taken beside it keeps it so
    assert client.pttl(limits) == -1
    sem.admin.set_limit("k", None)
    assert client.pttl(limits) > 0  # TATs alone again: they go once they have passed
    sem.client.close()


def _cli(app: Celery, *args: str) -> tuple[int, str]:
    ctx = type("Ctx", (), {"app": app})()
    out = CliRunner().invoke(semaphore_cli, list(args), obj=ctx)
    return out.exit_code, out.output


def test_a_live_rate_set_from_the_cli_wins_over_the_codes_until_cleared(
    app: Celery, client: redis.Redis
) -> None:
    code, said = _cli(app, "set-rate", "k", "2/s", "--burst", "1", "--by", "ops")
    assert code == 0, said
    assert "Live requests rate of 'k' set to 2/s (burst 1) (was none)." in said
    published = Published()
    sem = Semaphore(app.conf.semaphore_url, limit=5, on_handoff=published)
    first = sem.room.park("k", "w0", b"p", rates="100/s")
    assert isinstance(first, Slot)
    sem.room.park("k", "w1", b"p", rates="100/s")
    (handoff,) = published.made
    assert handoff.start_ms - round(first.acquired_at * 1000) == 500  # 2/s, not 100/s
    code, status = _cli(app, "status", "k")
    assert code == 0, status
    assert "rate requests: 0 of 1 free, one every 0.5s, next due " in status, status
    assert "(live rate 2/s burst 1, set by ops at " in status, status
    code, said = _cli(app, "set-rate", "k", "--clear")
    assert (code, "cleared (was 2/s burst 1)" in said) == (0, True), said
    assert sem.admin.set_rate("k", None) is None
    sem.client.close()


def test_a_cleared_live_rate_no_longer_spaces_the_next_starts(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    # An operator slows the code's 10/s to 6/m during an incident and clears it at once: the
    # runs already handed an instant keep it, and the next one follows 10/s again, not the
    # slow rate's schedule (38 s later, in a public report).
    published = Published()
    sem = Semaphore(redis_server.url, limit=5, on_handoff=published)
    sem.admin.set_rate("k", "6/m")
    first = sem.room.park("k", "w0", b"p", rates="10/s")
    assert isinstance(first, Slot)
    for n in (1, 2, 3):
        sem.room.park("k", f"w{n}", b"p", rates="10/s")
    assert [h.start_ms - round(first.acquired_at * 1000) for h in published.made] == [
        10_000, 20_000, 30_000
    ]  # fmt: skip
    sem.admin.set_rate("k", None)
    sem.room.park("k", "w4", b"p", rates="10/s")
    assert published.made[-1].waiter == "w4"
    assert published.made[-1].start_ms - _store_ms(client) < 2_000
    sem.client.close()


@pytest.mark.parametrize(
    "args",
    [["k", "500/x"], ["k", "0/m"], ["k", "5/s", "--name", "two words"], ["k"],
     ["k", "5/s", "--clear"], ["k", "5/s", "--burst", "0"]],
    ids=repr,
)  # fmt: skip
def test_a_bad_set_rate_is_refused_and_writes_nothing(
    app: Celery, client: redis.Redis, args: list[str]
) -> None:
    code, said = _cli(app, "set-rate", *args)
    assert code != 0, said
    assert client.keys("*") == []


def test_the_asyncio_admin_sets_and_clears_a_live_rate(redis_server: RedisServer) -> None:
    from celery_semaphore.asyncio import AsyncSemaphore

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=1) as sem:
            assert await sem.admin.set_rate("k", Rate("3/m", burst=2, name="tokens")) is None
            with pytest.raises(SemaphoreValidationError, match="like '10/s'"):
                await sem.admin.set_rate("k", "3/x")
            assert await sem.admin.set_rate("k", None, name="tokens") == "3/m burst 2"

    asyncio.run(main())


def test_the_metrics_show_each_rates_free_units_and_next_instant(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    from prometheus_client import CollectorRegistry

    from celery_semaphore.views.metrics import RoomCollector

    sem = Semaphore(redis_server.url, limit=1, on_handoff=Published())
    held = sem.room.park("k", "w0", b"p", rates=Rate("1/m", burst=2))  # takes a slot, 1 of 2
    assert isinstance(held, Slot)
    sem.room.park("k", "w1", b"p", rates=Rate("1/m", burst=2))  # waits for the slot
    registry = CollectorRegistry()
    registry.register(RoomCollector(client))
    labels = {"key": "k", "rate": "requests"}
    assert registry.get_sample_value("semaphore_rate_free_units", labels) == 1
    assert registry.get_sample_value("semaphore_rate_next_due_seconds", labels) == 0
    held.release()  # w1 is handed the last free unit: the next falls due in about a minute
    assert registry.get_sample_value("semaphore_rate_free_units", labels) is None  # room gone
    sem.client.close()


def test_why_says_where_a_run_waits_for_its_rate(app: Celery, client: redis.Redis) -> None:
    sem = Semaphore(app.conf.semaphore_url, limit=2, on_handoff=Published())
    assert isinstance(sem.room.park("k", "w0", b"p", rates="1/m"), Slot)
    sem.room.park("k", "w1", b"p", rates="1/m")  # reserved for a minute from now
    code, said = _cli(app, "why", "w1")
    assert code == 0, said
    assert "rate requests: 0 of 1 free, one every 60s, next due " in said, said
    code, said = _cli(app, "why", "w1", "--json")
    (standing,) = json.loads(said)["standings"]
    assert standing["state"] == "reserved"
    assert standing["rates"][0]["due_in"] > 30


def test_a_rate_declared_in_app_conf_semaphores_holds_its_tasks(app: Celery) -> None:
    """A rate declared once for a semaphore is every task's that names it, under the task's
    own; a bad declared rate is refused when the task is bound."""
    from celery_semaphore.integration.limits import declared_semaphores
    from celery_semaphore.integration.runner import Runner

    app.conf.semaphores = {"declared-rate": {"limit": 4, "rate": Rate("30/m", burst=2)}}

    @app.task(base=SemaphoreTask, semaphore="declared-rate", shared=False, name="rates.decl")
    def declared() -> None: ...

    runner: Runner = declared.run.__semaphore__
    (rate,) = runner.resolve(app).policy.rates
    assert (rate.spec, rate.burst) == ("30/m", 2)
    with pytest.raises(SemaphoreValidationError, match=r"semaphores\['bad-rate'\]: rate must be"):
        declared_semaphores({"bad-rate": {"limit": 4, "rate": "30/x"}})


def test_acquire_many_on_a_semaphore_with_a_rate_is_refused(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    """The several-keys script takes no rate: refused, rather than pass the rate unseen."""
    from celery_semaphore.asyncio import AsyncSemaphore

    sem = Semaphore(redis_server.url, limit=5, rate="10/s")
    with pytest.raises(SemaphoreValidationError, match="acquire_many takes no start rates"):
        sem.acquire_many([("a", 2), ("b", 2)])
    with (
        pytest.raises(SemaphoreValidationError, match="acquire_many takes no start rates"),
        sem.hold_many([("a", 2), ("b", 2)]),
    ):
        pass

    async def main() -> None:
        async with AsyncSemaphore(redis_server.url, limit=5, rate="10/s") as asem:
            with pytest.raises(SemaphoreValidationError, match="takes no start rates"):
                await asem.acquire_many([("a", 2), ("b", 2)])

    asyncio.run(main())
    assert client.keys("*") == []
    sem.client.close()


def test_a_several_keys_task_on_a_key_declared_with_a_rate_is_refused_at_bind(
    app: Celery, client: redis.Redis
) -> None:
    app.conf.semaphores = {"provider": {"limit": 4, "rate": "30/m"}}
    with pytest.raises(SemaphoreValidationError, match="'provider' declares a rate"):

        @app.task(base=SemaphoreTask, semaphore=[("provider", 4), ("tenant:{t}", 1)],
                  shared=False, name="rates.several")  # fmt: skip
        def several(t: str) -> None: ...

        several.name  # noqa: B018  (the app binds a task when it is first used)
    with pytest.raises(SemaphoreValidationError, match="'provider' declares a rate"):

        @bounded([("provider", 4), ("tenant:{t}", 1)], app=app)
        def plain(t: str) -> None: ...

    assert client.keys("*") == []


@pytest.mark.skipif(not rabbitmq_up(), reason="no RabbitMQ on 127.0.0.1:5672")
def test_a_hand_off_due_within_a_second_reaches_a_quorum_queue(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    """Celery's native delayed delivery (quorum queues and a topic exchange) turns an eta
    into whole seconds and refuses 0: a rate hand-off due in less than a second was never
    published, and its run started only after the claim timeout. It goes without an eta."""
    queue = f"csem-quorum-{uuid.uuid4().hex[:8]}"
    app = make_app(
        redis_server.url, broker_url=AMQP_URL, task_default_queue=queue,
        task_default_queue_type="quorum", task_default_exchange_type="topic",
    )  # fmt: skip
    try:
        with app.connection_for_write() as connection:  # the queue, bound as a worker would
            app.amqp.queues[queue](connection.default_channel).declare()
        task_id = str(uuid.uuid4())
        signature = app.signature("csem.queued", args=(1,), task_id=task_id)
        content_type, encoding, body = dumps(dict(signature), serializer="json")  # type: ignore[no-untyped-call]
        payload = f"{content_type}\n{encoding}\n".encode() + body.encode(encoding)
        due = _store_ms(client) + 500
        publisher_for(app, False)("k", [Handoff(task_id, payload, start_ms=due)])
        with app.connection_for_read() as connection:
            channel = connection.default_channel
            got: list[Any] = []
            assert wait_for(lambda: got.append(channel.basic_get(queue, no_ack=True)) or got[-1],
                            timeout=10)  # fmt: skip
        assert got[-1].headers["id"] == task_id
    finally:
        delete_queues(app, [queue], [queue])
        app.close()


def test_a_cleared_live_rate_no_longer_holds_a_plain_acquire(redis_server: RedisServer) -> None:
    # A refused acquire takes nothing: the slow rate's TAT, scaled to the code's rate from
    # each ask's own now and never written back, receded with every ask, and the call
    # waited out the whole cleared schedule (10 s) instead of the code's 100 ms.
    sem = Semaphore(redis_server.url, limit=2, rate="10/s")
    sem.admin.set_rate("k", "6/m")
    slot = sem.acquire("k")
    assert slot is not None
    slot.release()
    sem.admin.set_rate("k", None)
    started = time.monotonic()
    again = sem.acquire("k", wait=15.0)
    assert again is not None
    assert time.monotonic() - started < 2.0
    assert again.acquired_at - slot.acquired_at < 2.0  # by the store's clock too
    sem.client.close()


def test_the_stores_clock_offset_is_asked_once_a_minute_and_an_outage_waits_on_nothing(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hand-offs for a rate's instant are timed by this host's offset to the store's clock
    (a worker re-times each one it fetches): one TIME a minute, and a store out of reach
    costs one try a minute, never one per message in the worker's main loop."""
    from celery_semaphore.integration.waiting_room import handoffs

    asked: list[bool] = []
    real = handoffs.client_for

    def client_for(app: Celery) -> redis.Redis:
        asked.append(True)
        return real(app)

    monkeypatch.setattr(handoffs, "client_for", client_for)
    assert abs(handoffs.store_clock_offset(app)) < 1.0  # the store runs on this host
    assert abs(handoffs.store_clock_offset(app)) < 1.0
    assert len(asked) == 1

    def unreachable(app: Celery) -> redis.Redis:
        asked.append(True)
        raise redis.ConnectionError("the store is down")

    monkeypatch.setattr(handoffs, "client_for", unreachable)
    app.__dict__["_semaphore_clock"] = (-1, 2.5)  # measured in another minute: stale
    assert handoffs.store_clock_offset(app) == 2.5  # the last offset measured
    assert handoffs.store_clock_offset(app) == 2.5
    assert len(asked) == 2  # one try for the minute


def test_a_retry_from_a_rate_hand_off_keeps_its_own_countdown(app: Celery) -> None:
    """Proves: a run that came as a rate hand-off held for its instant (a message with the
    store's instant in a header, re-timed by the worker that fetches it) and then retries
    with ``countdown=8`` waits its 8 s: Celery's ``retry()`` copies the message's headers,
    and the copied instant, long past, must not re-time the retry's own eta. (Before: the
    retry ran at once, held only by the rate, about 3 s after the hand-off.)"""
    starts: list[tuple[int, int, float]] = []
    due: list[object] = []  # the instant header each run of n=1 came with

    @app.task(base=SemaphoreTask, semaphore="due-retry", limit=1, rate="20/m", bind=True,
              on_full="queue", shared=False, name="csem.due_retry")  # fmt: skip
    def due_retry(self: Any, n: int) -> int:
        starts.append((n, self.request.retries, time.time()))
        if n == 1:
            due.append(getattr(self.request, DUE_HEADER, None))
        if n == 1 and not self.request.retries:
            raise self.retry(countdown=8)
        return n

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        first = due_retry.delay(0)
        assert first.get(timeout=30) == 0
        handed = due_retry.delay(1)  # parks: the rate's next instant is 3 s after the first
        assert handed.get(timeout=60) == 1
    (_, _, handed_at), (_, retries, retried_at) = [s for s in starts if s[0] == 1]
    assert due[0] is not None, starts  # it came as a hand-off held for the rate's instant
    assert retries == 1
    assert retried_at - handed_at >= 6.0, starts
