"""Task options and app settings: checked at bind time, resolved with the right precedence."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from celery import Celery

from celery_semaphore import Adaptive, SemaphoreTask, SemaphoreValidationError, bounded
from celery_semaphore.integration.policy import Policy, countdown
from celery_semaphore.integration.runner import runner_of
from celery_semaphore.integration.settings import app_settings

# No Redis is contacted by anything here: options fail before any connection is made.
URL = "redis://127.0.0.1:1/0"

BAD_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("limit", {"limit": 0}),
    ("limit", {"limit": "5"}),
    ("limit", {"limit": None}),
    ("semaphore", {"semaphore": None}),
    ("semaphore", {"semaphore": ""}),
    ("semaphore", {"semaphore": 42}),
    ("semaphore", {"semaphore": "tenant:{}"}),
    ("semaphore", {"semaphore": "tenant:{0}"}),
    ("semaphore", {"semaphore": "tenant:{nope}"}),
    ("semaphore", {"semaphore": "tenant:{tenant_id"}),
    ("lease", {"lease": 0}),
    ("lease", {"lease": float("nan")}),
    ("heartbeat", {"heartbeat": 40.0}),  # above half the default 60 s lease
    ("heartbeat", {"heartbeat": -1}),
    ("on_full", {"on_full": "block"}),
    ("wait_timeout", {"wait_timeout": -1}),
    ("handoff_grace", {"handoff_grace": float("nan")}),
    ("on_lease_lost", {"on_lease_lost": "ignore"}),
    ("shed_countdown", {"shed_countdown": -1}),
    ("shed_backoff", {"shed_backoff": "yes"}),
    ("shed_max_countdown", {"shed_max_countdown": float("inf")}),
    ("shed_max_retries", {"shed_max_retries": -1}),
    ("shed_timeout", {"shed_timeout": -5}),
    ("queue_timeout", {"queue_timeout": float("nan")}),
    ("queue_timeout", {"queue_timeout": 10.0, "shed_timeout": 5.0}),
    ("interrupt", {"interrupt": 1}),
    ("back_off_on", {"back_off_on": (ValueError, 3)}),
    ("back_off_on", {"back_off_on": "ValueError"}),
    ("max_back_offs", {"max_back_offs": -1}),
    ("max_cool_down", {"max_cool_down": 0}),
    ("Adaptive", {"limit": {"*": 2, "k": Adaptive(2, max=3)}}),
]


def _options(overrides: dict[str, Any]) -> dict[str, Any]:
    return {"semaphore": "tenant:{tenant_id}", "limit": 2, **overrides}


@pytest.mark.parametrize(("name", "overrides"), BAD_OPTIONS)
def test_bad_task_option_fails_at_bind_naming_it(name: str, overrides: dict[str, Any]) -> None:
    app = Celery("bad", broker=URL, set_as_current=False)
    with pytest.raises(SemaphoreValidationError, match=name) as info:

        @app.task(base=SemaphoreTask, shared=False, name="bad.task", **_options(overrides))
        def task(tenant_id: str) -> None: ...

        app.finalize()
    assert "bad.task" in str(info.value)


@pytest.mark.parametrize(("name", "overrides"), BAD_OPTIONS)
def test_bad_decorator_option_fails_at_decoration(name: str, overrides: dict[str, Any]) -> None:
    options = _options(overrides)
    with pytest.raises(SemaphoreValidationError, match=name):

        @bounded(options.pop("semaphore"), options.pop("limit"), **options)
        def fn(tenant_id: str) -> None: ...


def test_unknown_decorator_option_is_named() -> None:
    with pytest.raises(SemaphoreValidationError, match="leese"):

        @bounded("k", 1, leese=5.0)
        def fn() -> None: ...


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("semaphore_lease", -1),
        ("semaphore_on_full", "block"),
        ("semaphore_url", "amqp://x//"),
        ("semaphore_flower_set_limit", "false"),
        ("semaphore_handoff_priority", -1),
        ("semaphore_handoff_priority", 256),
        ("semaphore_handoff_priority", "0"),
        ("semaphore_handoff_priority", True),
        ("semaphore_handoff_priority", 1.5),
        ("semaphore_handoff_queues", "false"),
        ("semaphore_handoff_queues", 1),
        ("semaphore_room_ttl", 0),
        ("semaphore_room_ttl", -5.0),
        ("semaphore_room_ttl", "1d"),
        ("semaphore_journal", ""),
        ("semaphore_journal", 1),
        ("semaphore_journal", ["dir"]),
        ("semaphore_sweep_interval", 0),
        ("semaphore_sweep_interval", 0.01),
        ("semaphore_sweep_interval", 7200),
        ("semaphore_sweep_interval", float("nan")),
        ("semaphore_sweep_interval", "2"),
        ("semaphore_sweep_interval", True),
    ],
)
def test_bad_app_setting_is_named(setting: str, value: Any) -> None:
    app = Celery("bad", broker=URL, set_as_current=False)
    app.conf[setting] = value
    with pytest.raises(SemaphoreValidationError, match=setting):
        app_settings(app)


def test_the_sweep_interval_defaults_to_two_seconds() -> None:
    assert app_settings(Celery("s", broker=URL, set_as_current=False)).sweep_interval == 2.0
    app = Celery("t", broker=URL, set_as_current=False)
    app.conf.semaphore_sweep_interval = 5
    assert app_settings(app).sweep_interval == 5.0


def test_the_flower_page_may_set_limits_unless_the_app_says_not() -> None:
    app = Celery("f", broker=URL, set_as_current=False)
    assert app_settings(app).flower_set_limit is True
    off = Celery("g", broker=URL, set_as_current=False)
    off.conf.semaphore_flower_set_limit = False
    assert app_settings(off).flower_set_limit is False


def test_url_defaults_to_a_redis_broker_then_a_redis_backend() -> None:
    assert app_settings(Celery("a", broker=URL, set_as_current=False)).url == URL
    amqp_app = Celery("b", broker="amqp://guest@127.0.0.1//", backend=URL, set_as_current=False)
    assert app_settings(amqp_app).url == URL
    neither = Celery("c", broker="amqp://guest@127.0.0.1//", set_as_current=False)
    with pytest.raises(SemaphoreValidationError, match="semaphore_url"):
        app_settings(neither)


def test_precedence_task_option_over_app_setting_over_default() -> None:
    app = Celery("p", broker=URL, set_as_current=False)
    app.conf.semaphore_lease = 30.0
    app.conf.semaphore_shed_countdown = 2.0

    @app.task(base=SemaphoreTask, semaphore="k", limit=3, lease=10.0, shared=False, name="p.t")
    def t() -> None: ...

    found = runner_of(app.tasks["p.t"])
    assert found is not None
    semaphore, policy, _ = found[0].resolve(app)
    assert policy.lease == 10.0  # task option
    assert policy.shed_countdown == 2.0  # app setting
    assert policy.on_full == "queue"  # default
    assert semaphore.lease == 10.0
    assert semaphore.limit == 3
    assert semaphore.prefix == "semaphore"


def test_countdown_backs_off_with_full_jitter_under_the_cap() -> None:
    policy = Policy(shed_countdown=1.0, shed_max_countdown=8.0)
    assert countdown(policy, 0, 0.5) == 0.5
    assert countdown(policy, 2, 0.5) == 2.0
    assert countdown(policy, 10, 0.999) == pytest.approx(8.0 * 0.999)
    assert countdown(policy, 10_000, 1.0) == 8.0
    flat = Policy(shed_countdown=3.0, shed_backoff=False)
    assert countdown(flat, 7, 0.1) == 3.0


def test_a_misspelt_setting_is_named() -> None:
    app = Celery("typo", broker=URL, set_as_current=False)
    app.conf.semaphore_leese = 5.0
    with pytest.raises(SemaphoreValidationError, match="semaphore_leese"):
        app_settings(app)


def test_bounded_above_app_task_is_refused() -> None:
    app = Celery("order", broker=URL, set_as_current=False)

    @app.task(shared=False, name="order.t")
    def t() -> None: ...

    with pytest.raises(SemaphoreValidationError, match=r"under @app\.task"):
        bounded("k", 1)(t)


def test_a_subclass_of_a_bound_task_gets_its_own_semaphore() -> None:
    app = Celery("sub", broker=URL, set_as_current=False)

    class Fetch(SemaphoreTask):  # type: ignore[misc]
        name = "sub.fetch_a"
        semaphore = "provider-a"
        limit = 1

        def run(self) -> None: ...

    class FetchB(Fetch):
        name = "sub.fetch_b"
        semaphore = "provider-b"
        limit = 5

    app.register_task(Fetch())
    app.register_task(FetchB())
    found_a = runner_of(app.tasks["sub.fetch_a"])
    found_b = runner_of(app.tasks["sub.fetch_b"])
    assert found_a is not None
    assert found_b is not None
    assert (found_a[0].template.source, found_a[0].limits.fixed) == ("provider-a", 1)  # type: ignore[union-attr]
    assert (found_b[0].template.source, found_b[0].limits.fixed) == ("provider-b", 5)  # type: ignore[union-attr]


def test_bad_app_option_for_bounded_is_named() -> None:
    with pytest.raises(SemaphoreValidationError, match="app"):

        @bounded("k", 1, app="not an app")  # type: ignore[arg-type]
        def fn() -> None: ...


def test_a_parked_runs_budget_is_queue_timeout_and_a_shedding_runs_is_shed_timeout() -> None:
    assert Policy(queue_timeout=9.0).queue_budget() == (9.0, "queue_timeout")
    assert Policy(queue_timeout=9.0, shed_timeout=9.0).queue_budget() == (9.0, "queue_timeout")
    assert Policy(shed_timeout=4.0).queue_budget() == (4.0, "shed_timeout")  # the old name
    assert Policy().queue_budget() == (None, "queue_timeout")
    # Outside a worker, a call waits as long as its mode's budget, else one lease.
    assert Policy(queue_timeout=9.0, shed_timeout=4.0).wait_budget() == 9.0
    assert Policy(on_full="wait", shed_timeout=4.0).wait_budget() == 4.0
    assert Policy(on_full="retry", queue_timeout=9.0, shed_timeout=4.0).wait_budget() == 4.0
    assert Policy(on_full="raise", queue_timeout=9.0).wait_budget() == Policy().lease


@pytest.mark.parametrize("where", ["task", "decorator", "declaration", "app"])
def test_queue_timeout_and_shed_timeout_that_differ_in_one_place_are_refused(
    where: str,
) -> None:
    app = Celery("both", broker=URL, set_as_current=False)
    both = {"queue_timeout": 30.0, "shed_timeout": 10.0}
    with pytest.raises(SemaphoreValidationError, match=r"queue_timeout.*shed_timeout.*differ"):
        if where == "app":
            app.conf.update({f"semaphore_{k}": v for k, v in both.items()})
            app_settings(app)
        elif where == "declaration":
            app.conf.semaphores = {"k": {"limit": 1, **both}}

            @app.task(base=SemaphoreTask, semaphore="k", shared=False, name="both.d")
            def declared() -> None: ...

            app.finalize()
        elif where == "decorator":

            @bounded("k", 1, app=app, **both)
            def plain() -> None: ...

        else:

            @app.task(base=SemaphoreTask, semaphore="k", limit=1, shared=False, name="both.t",
                      **both)  # fmt: skip
            def task() -> None: ...

            app.finalize()


def test_the_same_budget_under_both_names_and_in_different_places_is_accepted() -> None:
    app = Celery("ok", broker=URL, set_as_current=False)
    app.conf.semaphore_shed_timeout = 10.0  # for the tasks that shed

    @app.task(base=SemaphoreTask, semaphore="k", limit=1, queue_timeout=30.0, shed_timeout=30.0,
              shared=False, name="ok.same")  # fmt: skip
    def same() -> None: ...

    @app.task(base=SemaphoreTask, semaphore="k", limit=1, queue_timeout=60.0, shared=False,
              name="ok.apart")  # fmt: skip
    def apart() -> None: ...

    for name, budget in [("ok.same", 30.0), ("ok.apart", 60.0)]:
        found = runner_of(app.tasks[name])
        assert found is not None
        policy = found[0].resolve(app).policy
        assert (policy.queue_timeout, policy.queue_budget()[0]) == (budget, budget)
    assert app_settings(app).policy.shed_timeout == 10.0


def test_shed_timeout_as_a_parked_runs_budget_warns_once_per_task() -> None:
    app = Celery("old", broker=URL, set_as_current=False)

    @app.task(base=SemaphoreTask, semaphore="old", limit=1, shed_timeout=5.0, shared=False,
              name="old.parks")  # fmt: skip
    def parks() -> None: ...

    @app.task(base=SemaphoreTask, semaphore="old", limit=1, shed_timeout=5.0, on_full="retry",
              shared=False, name="old.sheds")  # fmt: skip
    def sheds() -> None: ...

    runner = runner_of(app.tasks["old.parks"])
    assert runner is not None
    with pytest.warns(DeprecationWarning, match=r"'old': shed_timeout .* name it queue_timeout"):
        assert runner[0].resolve(app).policy.queue_budget() == (5.0, "shed_timeout")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner[0].resolve(app)  # once per task: resolved (and warned) once per app
        shedding = runner_of(app.tasks["old.sheds"])
        assert shedding is not None
        shedding[0].resolve(app)  # shed_timeout is that task's own budget: no warning
