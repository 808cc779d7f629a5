"""The core semaphore against a real redis-server."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest
import redis

from celery_semaphore import (
    Semaphore,
    SemaphoreBackendError,
    SemaphoreError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
    Slot,
)
from celery_semaphore.testing import RedisServer

from .helpers import (
    ROOT,
    acquire_at_once,
    assert_force_release_is_reported,
    run_callers,
    wait_for,
)
from .history import BODIES, History

MakeSemaphore = Callable[..., Semaphore]


def test_25_callers_on_limit_20_get_exactly_20_slots(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=20)
    results: list[Slot | None] = acquire_at_once(sem, "openai", 25)
    slots = [s for s in results if s is not None]
    assert len(slots) == 20
    assert results.count(None) == 5
    assert sem.count("openai") == 20
    assert sem.available("openai") == 0
    assert len({s.token for s in slots}) == 20
    for s in slots:
        assert s.release() is True
    assert sem.count("openai") == 0


def test_50_threads_on_limit_5_with_retries_never_exceed_5(
    make_semaphore: MakeSemaphore, client: redis.Redis
) -> None:
    sem = make_semaphore(limit=5, lease=10.0)
    callers = run_callers(sem, "legacy-api", client, 50)
    History.load(client, BODIES).assert_ok({"legacy-api": 5}, tasks=callers)
    assert sem.count("legacy-api") == 0


def test_retries_exhausted_returns_none_and_hold_raises(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=1)
    held = sem.acquire("k")
    assert held is not None
    assert sem.acquire("k", retries=2, retry_delay=0.01) is None
    with pytest.raises(SemaphoreNotAcquiredError) as info, sem.hold("k"):
        pytest.fail("body must not run")
    assert info.value.key == "k"
    assert info.value.limit == 1
    with pytest.raises(SemaphoreNotAcquiredError):
        sem.run("k", lambda slot: None)
    held.release()


def test_killed_holder_frees_its_slot_within_one_lease(
    redis_server: RedisServer, client: redis.Redis
) -> None:
    lease = 2.0
    code = textwrap.dedent(
        f"""
        import time, redis
        from celery_semaphore import Semaphore
        from tests import history
        sem = Semaphore({redis_server.url!r}, limit=1, lease={lease})
        slot = sem.acquire("crash")
        assert slot is not None
        recorder = redis.Redis.from_url({redis_server.url!r})
        with history.run(recorder, {BODIES!r}, "crash", task_id="child", mark_start=True):
            time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        assert wait_for(lambda: History.load(client, BODIES).runs, timeout=30)
        taken_by = time.monotonic()
        sem = Semaphore(redis_server.url, limit=1, lease=lease)
        assert sem.acquire("crash") is None
        proc.kill()
        proc.wait()
        slot = sem.acquire("crash", retries=1000, retry_delay=0.02)
        assert slot is not None
        # The child's lease started before its body did; allow generous scheduling slack.
        assert time.monotonic() - taken_by < lease + 1.5
        slot.release()
    finally:
        proc.kill()
        proc.wait()
    History.load(client, BODIES).assert_ok({"crash": 1}, tasks=[], killed=["child"])


def test_hold_keeps_its_slot_through_a_body_three_times_the_lease(
    make_semaphore: MakeSemaphore,
) -> None:
    sem = make_semaphore(limit=1, lease=1.0)
    intruders: list[Slot] = []
    with sem.hold("long") as slot:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            other = sem.acquire("long")
            if other is not None:
                intruders.append(other)
            assert not slot.lost.wait(0.1)
    assert intruders == []
    assert not slot.lost.is_set()
    assert sem.count("long") == 0


def test_without_heartbeat_a_long_body_loses_its_lease(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=1, lease=1.0)
    with pytest.raises(SemaphoreLeaseLostError) as info, sem.hold("long", heartbeat=False) as slot:
        time.sleep(1.6)
    assert slot.lost.is_set()
    assert info.value.key == "long"
    assert info.value.limit == 1


def test_force_release_all_makes_the_next_renewal_report_loss(
    make_semaphore: MakeSemaphore,
) -> None:
    holder, operator = make_semaphore(limit=3, lease=2.0), make_semaphore(limit=3)
    assert_force_release_is_reported(holder, operator.admin)


def test_a_failing_body_keeps_its_own_exception_even_when_the_slot_was_lost(
    make_semaphore: MakeSemaphore,
) -> None:
    sem = make_semaphore(limit=1, lease=2.0)
    with pytest.raises(KeyError), sem.hold("k", heartbeat=0.1) as slot:
        sem.admin.force_release_all("k")
        assert slot.lost.wait(10)
        raise KeyError("the body's own failure")
    assert slot.lost.is_set()


def test_a_body_that_raises_releases_its_slot(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=1)
    with pytest.raises(RuntimeError), sem.hold("k"):
        raise RuntimeError("boom")
    assert sem.count("k") == 0


def test_run_returns_the_body_result_and_passes_the_slot(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=2)
    assert sem.run("k", lambda slot: (slot.key, slot.limit, sem.count("k"))) == ("k", 2, 1)
    assert sem.count("k") == 0


def test_extend_release_and_context_manager(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=1, lease=5.0)
    slot = sem.acquire("k")
    assert slot is not None
    before = slot.expires_at
    assert slot.extend(lease=10.0) is True
    assert slot.lease == 10.0
    assert slot.expires_at > before
    with slot:
        assert sem.count("k") == 1
    assert sem.count("k") == 0
    assert slot.release() is True  # repeats the first answer, no new round trip
    assert slot.extend() is False
    assert not slot.lost.is_set()


def test_release_after_the_lease_lapsed_reports_false(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=1, lease=0.2)
    slot = sem.acquire("k")
    assert slot is not None
    other = sem.acquire("k", retries=200, retry_delay=0.01)  # admitted once the lease lapses
    assert other is not None
    assert slot.extend() is False
    assert slot.lost.is_set()
    assert slot.release() is False
    assert other.release() is True


def test_holders_show_metadata_and_times(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=2, lease=30.0)
    slot = sem.acquire("k", metadata={"task_id": "abc", "task_name": "tasks.add"})
    assert slot is not None
    [holder] = sem.admin.holders("k")
    assert holder.token == slot.token
    assert holder.metadata["task_id"] == "abc"
    assert holder.metadata["task_name"] == "tasks.add"
    assert holder.metadata["limit"] == 2
    assert isinstance(holder.metadata["pid"], int)
    assert 29.0 < holder.expires_in <= 30.0
    assert 0 <= holder.held_for < 1.0
    # acquired_at is the acquiring host's clock when it sent the acquire (the record rides
    # in the member), expires_at the server's: a round trip apart, here on one machine.
    assert holder.expires_at - holder.acquired_at == pytest.approx(30.0, abs=1.0)
    slot.release()
    assert sem.admin.holders("k") == []


def test_keys_get_a_ttl_and_an_empty_semaphore_is_deleted(
    make_semaphore: MakeSemaphore, client: redis.Redis
) -> None:
    sem = make_semaphore(limit=2, lease=5.0, prefix="app")
    slot = sem.acquire("k")
    assert slot is not None
    # The holder's record is in its member: one Redis key, no holders hash.
    assert client.keys("*") == [b"app:{k}"]
    # At least the lease (the key outlives it), at most two (the TTL's headroom).
    assert 4900 < client.pttl("app:{k}") <= 10000
    slot.release()
    assert client.keys("*") == []


@pytest.mark.parametrize(
    "key", ["ünïcødé ✓", "with spaces", "a:b:c", "{braces}", "}lead", "{", "x" * 300]
)
def test_any_non_empty_key_works_and_keys_are_independent(
    make_semaphore: MakeSemaphore, key: str
) -> None:
    sem = make_semaphore(limit=1)
    slot = sem.acquire(key)
    assert slot is not None
    assert sem.acquire(key) is None
    other = sem.acquire(key + "-other")
    assert other is not None
    assert sem.admin.holders(key)[0].token == slot.token
    assert slot.release()
    assert other.release()
    assert sem.count(key) == 0


def test_a_resent_acquire_with_the_same_token_takes_no_second_slot(
    make_semaphore: MakeSemaphore,
) -> None:
    # What a client retry after a lost reply does: the same call, same token, twice.
    from celery_semaphore.core.names import redis_keys
    from celery_semaphore.core.replies import Admitted

    sem = make_semaphore(limit=2)
    keys = redis_keys(sem.prefix, "k")
    first = sem._scripts.acquire(keys, 2, 5000, "tok")
    again = sem._scripts.acquire(keys, 2, 5000, "tok")
    assert isinstance(first, Admitted)
    assert isinstance(again, Admitted)
    assert again.expires_at_ms == first.expires_at_ms
    assert sem.count("k") == 1


@pytest.mark.parametrize("options", [{"protocol": 3}, {"decode_responses": True}])
def test_resp3_and_decoding_clients(redis_server: RedisServer, options: dict[str, object]) -> None:
    sem = Semaphore(redis_server.client(**options), limit=1, lease=5.0)
    slot = sem.acquire("k", metadata={"n": 1})
    assert slot is not None
    assert sem.acquire("k") is None
    assert sem.admin.holders("k")[0].metadata["n"] == 1
    assert slot.extend() is True
    assert slot.release() is True
    assert sem.admin.force_release_all("k") == 0


def test_renew_errors_are_reported_and_do_not_lose_the_slot(own_redis: RedisServer) -> None:
    # A 0.2 s socket timeout and a 0.7 s CLIENT PAUSE make one renewal round trip fail.
    sem = Semaphore(own_redis.client(socket_timeout=0.2, retry=None), limit=1, lease=3.0)
    admin = own_redis.client()
    errors: list[BaseException] = []
    seen_error = threading.Event()

    def on_renew_error(error: BaseException) -> None:
        errors.append(error)
        seen_error.set()

    with sem.hold("k", heartbeat=0.3, on_renew_error=on_renew_error) as slot:
        admin.execute_command("CLIENT", "PAUSE", "700", "WRITE")
        assert seen_error.wait(10)
        expires = slot.expires_at
        deadline = time.monotonic() + 10
        while slot.expires_at == expires and time.monotonic() < deadline:
            assert not slot.lost.wait(0.05)
        assert slot.expires_at > expires, "no renewal succeeded after the pause"
    assert not slot.lost.is_set()
    assert isinstance(errors[0], SemaphoreBackendError)
    assert isinstance(errors[0].__cause__, redis.TimeoutError)


def test_a_renewal_that_hangs_is_a_loss_by_the_deadline(own_redis: RedisServer) -> None:
    # No socket timeout at all: the renewal round trip hangs for as long as Redis is frozen.
    sem = Semaphore(own_redis.client(socket_timeout=None, retry=None), limit=1, lease=1.0)
    with pytest.raises(SemaphoreLeaseLostError), sem.hold("k") as slot:
        own_redis.pause()
        try:
            started = time.monotonic()
            assert slot.lost.wait(10)
            assert time.monotonic() - started < 5
        finally:
            own_redis.resume()
    assert "within one lease" in str(slot.lease_lost_error())


def test_redis_down_raises_backend_error_promptly(own_redis: RedisServer) -> None:
    sem = Semaphore(own_redis.url, limit=1)
    own_redis.stop()
    started = time.monotonic()
    with pytest.raises(SemaphoreBackendError) as info:
        sem.acquire("k")
    assert time.monotonic() - started < 5
    assert info.value.key == "k"
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    with pytest.raises(SemaphoreBackendError):
        sem.count("k")


def test_a_key_of_the_wrong_type_is_a_backend_error(
    make_semaphore: MakeSemaphore, client: redis.Redis
) -> None:
    client.set("semaphore:{k}", "not a sorted set")
    sem = make_semaphore(limit=1)
    with pytest.raises(SemaphoreBackendError) as info:
        sem.acquire("k")
    assert isinstance(info.value.__cause__, redis.ResponseError)
    assert "WRONGTYPE" in str(info.value)


def test_errors_pickle_with_their_context() -> None:
    for cls in (SemaphoreNotAcquiredError, SemaphoreLeaseLostError, SemaphoreValidationError):
        error = cls("message", "key", 3)
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is cls
        assert (str(copy), copy.key, copy.limit) == ("message", "key", 3)
        assert isinstance(copy, SemaphoreError)
    assert isinstance(SemaphoreValidationError("x"), ValueError)


def test_package_exports() -> None:
    import celery_semaphore

    for name in celery_semaphore.__all__:
        assert getattr(celery_semaphore, name) is not None


def test_failing_renewals_are_a_loss_at_the_deadline_not_a_tick_later(
    own_redis: RedisServer,
) -> None:
    # Renewal every 1 s on a 2 s lease; the server goes away (connection refused), so each
    # renewal fails fast. The loss must be declared when the lease runs out, not at the next
    # tick after it (up to 1 s later).
    sem = Semaphore(own_redis.client(retry=None), limit=1, lease=2.0)
    errors: list[BaseException] = []
    with (
        pytest.raises(SemaphoreLeaseLostError),
        sem.hold("k", heartbeat=1.0, on_renew_error=errors.append) as slot,
    ):
        own_redis.stop()
        assert slot.lost.wait(10)
        late = time.monotonic() - slot.deadline
    assert errors, "no renewal failure was reported"
    assert late < 0.5, f"the loss was declared {late:.2f}s after the deadline"


def test_releasing_early_inside_hold_is_not_a_loss(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=1, lease=0.5)
    with sem.hold("k", heartbeat=0.1) as slot:
        assert slot.release() is True
        other = sem.acquire("k")  # the slot really is free again
        assert other is not None
        time.sleep(1.0)  # longer than the lease, with the slot given back
    assert not slot.lost.is_set()
    other.release()


def test_a_shorter_lease_inside_hold_is_renewed_in_time(make_semaphore: MakeSemaphore) -> None:
    sem = make_semaphore(limit=1, lease=4.0)
    with sem.hold("k", heartbeat=1.0) as slot:
        assert slot.extend(lease=0.4) is True
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            assert sem.acquire("k") is None, "another holder got in: the slot lapsed"
            assert not slot.lost.wait(0.05)
    assert not slot.lost.is_set()


def test_an_acquire_answered_after_a_whole_lease_gives_the_slot_back(
    own_redis: RedisServer,
) -> None:
    sem = Semaphore(own_redis.client(socket_timeout=None, retry=None), limit=1, lease=0.5)
    sem.count("k")  # load the scripts first, so the paused call is the acquire itself
    result: list[Slot | None] = []
    own_redis.pause()
    caller = threading.Thread(target=lambda: result.append(sem.acquire("k")))
    try:
        caller.start()
        time.sleep(1.0)  # the fault: the reply is held back for two leases
    finally:
        own_redis.resume()
    caller.join(timeout=30)
    assert result == [None]
    assert sem.count("k") == 0


class _SlowRenewals(redis.Redis):
    """A client whose renewals (extend.lua) wait 0.3 s before they are sent: slow replies
    from a healthy server (fault injection; Redis itself is real)."""

    slow_sha = ""

    def execute_command(self, *args: object, **options: object) -> object:
        sha = args[1] if len(args) > 1 and args[0] == "EVALSHA" else b""
        if self.slow_sha and (sha.decode() if isinstance(sha, bytes) else sha) == self.slow_sha:
            time.sleep(0.3)
        return super().execute_command(*args, **options)


def test_slow_renewal_replies_are_not_a_loss(redis_server: RedisServer) -> None:
    client = _SlowRenewals(host="127.0.0.1", port=redis_server.port, socket_timeout=5)
    sem = Semaphore(client, limit=1, lease=1.0)
    warm = sem.acquire("k")  # loads the scripts, so that only renewals are slow below
    assert warm is not None
    assert warm.extend() is True
    warm.release()
    client.slow_sha = sem._scripts._scripts["extend"].sha
    # Renewals every 0.5 s on a 1 s lease, each answered 0.3 s after it is due.
    with sem.hold("k", heartbeat=0.5) as slot:
        assert not slot.lost.wait(3.0)
    assert not slot.lost.is_set()


def test_a_holders_record_rides_in_its_member_and_operators_name_it_by_its_token(
    make_semaphore: MakeSemaphore, client: redis.Redis
) -> None:
    sem = make_semaphore(limit=3, prefix="app")
    slot = sem.acquire("k", metadata={"note": "a #hash, a | bar"}, weight=2)
    assert slot is not None
    assert "|" not in slot.token
    assert client.exists("app:{k}:holders") == 0  # one key written, not two
    (holder,) = sem.admin.holders("k")  # its second unit is not a holder of its own
    assert holder.token == slot.token
    assert holder.metadata["note"] == "a #hash, a | bar"
    assert holder.metadata["weight"] == 2
    assert 0 <= holder.held_for < 60
    assert sem.admin.force_release("k", holder.token) is True  # by the token the views show
    assert sem.count("k") == 0
    assert slot.release() is False
