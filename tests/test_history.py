"""The history checker (tests/history.py) on hand-made histories: what it accepts, and that
its failure names what broke."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import redis
from celery import Celery

from celery_semaphore.testing import RedisServer

from . import history
from .helpers import ROOT, run_in_threads
from .history import History, history_key


def _record(
    client: redis.Redis, *runs: tuple[str, str, float, float | None], **extra: object
) -> History:
    """Push ``(key, task, start, end)`` runs (end None: never ended) into history "h"."""
    for key, task, start, end in runs:
        event = {"run": uuid.uuid4().hex, "key": key, "task": task, "weight": 1, "worker": "w",
                 "pid": 1, "start": start, "data": {}, **extra}  # fmt: skip
        if end is not None:
            event["end"] = end
        client.rpush(history_key("h"), json.dumps(event))
    return History.load(client, "h")


def test_the_peak_counts_runs_in_flight_and_an_end_at_a_start_is_not_both(
    client: redis.Redis,
) -> None:
    h = _record(client, ("k", "a", 0, 1), ("k", "b", 1, 2), ("k", "c", 1.5, 1.5), ("j", "d", 0, 9))
    assert h.peak("k") == 2  # b and the zero-length c
    assert h.peak() == 3
    report = h.assert_ok({"k": 2, "j": 1}, tasks=["a", "b", "c", "d"])
    assert report.peaks == {"j": 1, "k": 2}


def test_a_failure_names_the_key_the_moment_and_the_tasks_in_flight(client: redis.Redis) -> None:
    h = _record(client, ("k", "a", 0, 2), ("k", "b", 1, 3), ("other", "c", 0, 1))
    with pytest.raises(AssertionError) as info:
        h.assert_ok({"k": 1})
    message = str(info.value)
    assert "key 'k': 2 in flight (limit 1) at +1.000s when b started: a, b" in message
    assert "key 'other': 1 run(s) but no limit given" in message


def test_a_schedule_of_limits_judges_each_start_by_the_limit_then(client: redis.Redis) -> None:
    h = _record(client, ("k", "a", 0, 10), ("k", "b", 1, 10), ("k", "c", 6, 10))
    # Two were allowed until t=5, one after: b's start was fine, c's was not.
    report = h.check({"k": [(0.0, 2), (5.0, 1)]})
    assert report.problems == ["key 'k': 3 in flight (limit 1) at +6.000s when c started: a, b, c"]
    assert h.check({"k": [(0.0, 1), (5.0, 3)]}).problems[0].startswith("key 'k': 2 in flight")


def test_a_limit_schedule_raises_when_sent_and_lowers_a_grace_after_the_answer() -> None:
    """A raise may admit as soon as it is sent; a lowering binds only ``grace`` after it was
    answered, since a slot granted just before may begin its body that much later."""
    changes = [(10.0, 10.5, 6), (20.0, 20.5, 2), (22.0, 22.5, 3)]
    schedule = history.limit_schedule(4, changes, grace=3.0)
    assert schedule == [(float("-inf"), 4), (10.0, 6), (23.5, 3)]
    # The lowering to 2 never binds alone: the raise to 3 came within its grace.
    assert history.limit_schedule(4, [(10.0, 10.5, 2)], grace=1.0) == [
        (float("-inf"), 4), (11.5, 2)]  # fmt: skip


def test_a_lowered_limit_judges_later_starts_with_the_older_holders_counted(
    client: redis.Redis,
) -> None:
    """Lowering evicts nobody: holders admitted before keep running, and a run may start
    after the lowering only when the weight in flight, theirs included, fits the new limit."""
    schedule = history.limit_schedule(3, [(5.0, 5.1, 1)], grace=1.0)
    fits = _record(client, ("k", "a", 4, 9), ("k", "b", 4.5, 5.5), ("k", "c", 5.8, 7))
    assert fits.check({"k": schedule}).ok  # c started within the grace, under the old limit
    late = _record(client, ("k", "d", 6.5, 7))
    [problem] = late.check({"k": schedule}).problems
    assert problem.startswith("key 'k': 3 in flight (limit 1)")  # a and c still held


def test_a_run_of_several_keys_counts_under_each_and_once_per_task(client: redis.Redis) -> None:
    h = _record(client, ("a", "x", 0, 2), ("a", "y", 1, 3), keys=["a", "b"])
    assert [r.keys for r in h.runs] == [("a", "b"), ("a", "b")]
    assert h.of("b").peak() == 2
    assert h.check({"a": 2, "b": 2}, tasks=["x", "y"]).ok
    problems = h.check({"a": 2, "b": 1}).problems
    assert problems == ["key 'b': 2 in flight (limit 1) at +1.000s when y started: x, y"]
    assert "key 'b': 2 run(s) but no limit given" in h.check({"a": 2}).problems


def test_a_wipe_ends_the_slots_granted_before_it(client: redis.Redis) -> None:
    """A restart without persistence: slots the store granted before it are gone, so bodies
    that run on count only until then, and runs granted slots after it are judged alone."""
    _record(client, ("k", "a", 0, 6), ("k", "b", 4.9, 5.2), data={"admitted": 100.0})
    h = _record(client, ("k", "c", 5.5, 7), ("k", "d", 5.6, 7), data={"admitted": 105.5})
    assert not h.check({"k": 2}).ok  # a, c and d overlap
    report = h.check({"k": 2}, wiped=[(5.0, 105.0)])
    assert report.ok, report
    assert report.peaks == {"k": 2}  # a and b before the wipe, c and d after
    problems = h.check({"k": 1}, wiped=[(5.0, 105.0)]).problems
    assert [p.split(" when ")[1].split(":")[0] for p in problems] == ["b started", "d started"]


def test_tasks_may_be_missing_only_for_a_reason_named(client: redis.Redis) -> None:
    h = _record(client, ("k", "a", 0, 1))
    assert [p.split(":")[0] for p in h.check({"k": 1}, tasks=["a", "b", "c"]).problems] == [
        "task b", "task c"]  # fmt: skip
    why = {"parked at a restart": ["b"], "handed a slot at a restart": ["b", "x"]}
    report = h.check({"k": 1}, tasks=["a", "b", "c"], may_miss=why)
    assert [p.split(":")[0] for p in report.problems] == ["task c"]
    assert report.excused == {"parked at a restart": 1}  # b once, under the first reason
    assert "tasks missing: 2, 1 parked at a restart" in report.summary()


def test_runs_per_task_missing_unexpected_and_named_repeats(client: redis.Redis) -> None:
    h = _record(client, ("k", "a", 0, 1), ("k", "a", 2, 3), ("k", "x", 4, 5))
    problems = h.check({"k": 1}, tasks=["a", "b"]).problems
    assert [p.split(":")[0] for p in problems] == ["task a", "task x", "task b"]
    assert "2 completed runs (allowed 1)" in problems[0]
    assert "not expected to run" in problems[1]
    assert "expected, but no run of it completed (never started)" in problems[2]
    report = h.check({"k": 1}, tasks=["a", "x"], repeats={"the test retries it": ["a"]})
    assert report.ok, report
    assert report.repeated == {"again (the test retries it)": 1}


def test_a_killed_run_is_visible_and_allowed_only_when_the_test_killed_it(
    client: redis.Redis,
) -> None:
    h = _record(client, ("k", "a", 0, None), ("k", "a", 1, 2), ("k", "b", 3, 4))
    assert "not killed by the test" in h.check({"k": 1}).problems[0]
    assert h.check({"k": 1}, tasks=["a", "b"], killed=["a"]).ok
    assert "but 0 of its runs never ended" in h.check({"k": 1}, killed=["b"]).problems[-1]
    # A killed pid: its runs may be unfinished, and its last completed run may run again.
    again = _record(client, ("k", "b", 5, 6))
    assert any("2 completed runs" in p for p in again.check({"k": 1}).problems)
    assert again.check({"k": 1}, killed_pids=[1]).ok


def test_a_killed_process_may_run_again_the_task_it_was_delivered_last(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    """A task that never reached a body in the killed process (it shed there) is allowed a
    second completed run, if its delivery was recorded; an older delivery there is not."""
    app = Celery("history_test", set_as_current=False)

    @app.task(name="csem.history_probe", shared=False)
    def shed_then_ran() -> None:
        """Stands for a delivery that shed: no body recorded in this process."""

    history.record_deliveries(client, "h", "csem.history_probe")
    for task_id in ("old", "b"):
        shed_then_ran.apply(task_id=task_id)
    h = _record(client, ("k", "old", 0, 1), ("k", "old", 2, 3), ("k", "b", 4, 5), ("k", "b", 6, 7))
    assert h.deliveries == [("old", os.getpid()), ("b", os.getpid())]
    problems = h.check({"k": 1}, killed_pids=[os.getpid()]).problems
    assert [p.split(":")[0] for p in problems] == ["task old"]
    assert "2 completed runs (allowed 1)" in problems[0]
    assert "its process was killed while it ran" not in problems[0]
    report = h.check({"k": 1}, killed_pids=[os.getpid()], repeats={"a test": ["old"]})
    assert report.repeated == {"again (its process was killed while it ran the task)": 1,
                               "again (a test)": 1}  # fmt: skip


def test_lost_slots_leave_the_peak_and_must_be_expected(client: redis.Redis) -> None:
    h = _record(client, ("k", "a", 0, 2), ("k", "b", 1, 3), lost=True)
    assert h.peak("k") == 0
    assert len(h.check({"k": 1}).problems) == 2
    assert h.check({"k": 1}, lost=["a", "b"]).ok
    assert h.check({"k": 1}, may_lose="the store froze").ok
    assert "no run of it did" in _record(client).check({"k": 1}, lost=["c"]).problems[-1]


def test_run_records_threads_and_subprocesses_and_a_kill_mid_run(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    numbers = itertools.count()

    def body() -> None:
        n = next(numbers)
        with history.run(client, "h", "k", task_id=f"t{n}", data={"n": n}) as recording:
            recording.data["seen"] = True

    run_in_threads(body, 3)
    code = textwrap.dedent(
        f"""
        import os, redis
        from tests import history
        client = redis.Redis.from_url({redis_server.url!r})
        with history.run(client, "h", "k", task_id="child", worker="sub", mark_start=True):
            os.kill(os.getpid(), 9)
        """
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == -9
    h = History.load(client, "h")
    assert sorted(h.values("n", completed=True)) == [0, 1, 2]
    assert all(r.data["seen"] and r.pid == os.getpid() for r in h.completed)
    [child] = h.unfinished
    assert (child.task_id, child.worker, child.end) == ("child", "sub", None)
    h.assert_ok({"k": 3}, tasks=["t0", "t1", "t2"], killed=["child"])
