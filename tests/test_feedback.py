"""Provider feedback in the core: a back-off cools a key down for every caller, an adaptive
limit is cut once per cool-down and grows back under success, and every bad value is
refused before anything is written. On a real redis-server; the Celery side is in
tests/test_feedback_celery.py."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import os
import threading
import time
from typing import ClassVar

import pytest

from celery_semaphore import Adaptive, BackOff, Rate, Semaphore, SemaphoreValidationError
from celery_semaphore.asyncio import AsyncSemaphore
from celery_semaphore.core.feedback import retry_after_seconds
from celery_semaphore.testing import RedisServer

from .test_asyncio import close


def _store_now(sem: Semaphore) -> float:
    seconds, micros = sem.client.time()
    return float(seconds) + micros / 1e6


def test_a_back_off_cools_the_key_down_for_every_caller_until_its_hint_runs_out(
    make_semaphore: type[Semaphore],
) -> None:
    sem, other = make_semaphore(limit=3), make_semaphore(limit=3)
    running, backing = sem.acquire("k"), sem.acquire("k")
    assert running is not None
    assert backing is not None
    before = _store_now(sem)
    ends = backing.back_off(retry_after=1.5)
    assert before + 1.4 < ends < _store_now(sem) + 1.6
    assert backing.released
    assert other.acquire("k") is None  # every caller: two slots free, none given
    assert running.extend()  # a body already running goes on
    waited = time.monotonic()
    slot = other.acquire("k", wait=10.0)  # waits out the cool-down, then gets its slot
    assert slot is not None
    assert time.monotonic() - waited > 0.5
    assert _store_now(sem) >= ends
    feedback = sem.admin.feedback("k")
    assert feedback is not None
    assert feedback.back_offs == 1
    assert feedback.last_hint == 1.5
    assert feedback.limit is None
    assert feedback.last_by.endswith(f":{os.getpid()}")
    # The state lapses by itself a day after its last change: no key is left for ever.
    assert 0 < sem.client.pttl(sem.names.keys_of("k").limits) <= 86_400_000


def test_with_no_hint_the_cool_down_starts_at_a_second_and_doubles_while_back_offs_follow(
    make_semaphore: type[Semaphore],
) -> None:
    sem = make_semaphore(limit=5)
    lengths = []
    for _ in range(3):
        slot = sem.acquire("k", wait=10.0)
        assert slot is not None
        started = _store_now(sem)
        lengths.append(slot.back_off() - started)
    assert 0.8 < lengths[0] < 1.2
    assert 1.8 < lengths[1] < 2.3
    assert 3.8 < lengths[2] < 4.3


def test_a_hint_past_the_longest_cool_down_is_clamped_and_logged(
    make_semaphore: type[Semaphore], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_semaphore.core.lease")
    sem = make_semaphore(limit=2, max_cool_down=2.0)
    slot = sem.acquire("k")
    assert slot is not None
    started = _store_now(sem)
    assert slot.back_off(3600) - started < 2.5
    assert "clamped to 2s" in caplog.text


def test_an_adaptive_limit_is_cut_once_per_cool_down_and_grows_back_under_success(
    make_semaphore: type[Semaphore],
) -> None:
    sem = make_semaphore(limit=Adaptive(8, min=2, max=10))
    slots = [sem.acquire("k") for _ in range(8)]
    assert all(slots)
    assert sem.acquire("k") is None
    first, *rest = slots
    assert first is not None
    first.back_off(0.2)
    for late in rest[:3]:  # started before the cut: their 429s answer a limit already cut
        assert late is not None
        late.back_off(0.2)
    feedback = sem.admin.feedback("k")
    assert feedback is not None
    assert feedback.limit == 4
    assert feedback.back_offs == 4
    for slot in rest[3:]:
        assert slot is not None
        slot.release()
    # Saturated (every slot held) runs that end well raise it about one per limit of them,
    # back to one under the limit the cut came at (8), where it holds until a probe is due
    # (10 s after the cool-down: on a loaded machine the rounds may take that long).
    probe_due = feedback.cooling_until + 10.0
    for _ in range(60):
        held = [sem.acquire("k", wait=5.0)]
        while held[-1] is not None:
            held.append(sem.acquire("k"))
        for slot in held[:-1]:
            assert slot is not None
            slot.release()
        feedback = sem.admin.feedback("k")
        assert feedback is not None
        if feedback.limit == 7:
            break
    assert feedback.limit == 7 or _store_now(sem) > probe_due, feedback
    assert (feedback.min, feedback.max) == (2, 10)
    held = [sem.acquire("k") for _ in range(8)]
    assert held.count(None) == 1 or _store_now(sem) > probe_due  # 7 slots, not the 8th


def test_an_operator_limit_wins_over_the_adaptive_one_until_cleared(
    make_semaphore: type[Semaphore],
) -> None:
    sem = make_semaphore(limit=Adaptive(4, max=8))
    sem.admin.set_limit("k", 1)
    one = sem.acquire("k")
    assert one is not None
    assert sem.acquire("k") is None
    one.release()
    sem.admin.set_limit("k", None)
    held = [sem.acquire("k") for _ in range(4)]
    assert all(held)
    assert sem.acquire("k") is None


def test_a_with_block_that_raises_back_off_backs_off_and_the_error_goes_on(
    make_semaphore: type[Semaphore],
) -> None:
    sem = make_semaphore(limit=2)
    with pytest.raises(BackOff), sem.hold("k"):
        raise BackOff(retry_after="1")
    assert sem.acquire("k") is None
    feedback = sem.admin.feedback("k")
    assert feedback is not None
    assert feedback.cooling(_store_now(sem))


def test_a_group_backs_off_the_key_its_back_off_names(make_semaphore: type[Semaphore]) -> None:
    sem = make_semaphore(limit=2)
    with pytest.raises(BackOff), sem.acquire_many([("{t}a", 2), ("{t}b", 2)]) as group:
        raise BackOff(5, key="{t}b")
    assert all(slot.released for slot in group.slots)
    assert sem.acquire("{t}a") is not None
    assert sem.acquire("{t}b") is None


def test_the_asyncio_semaphore_obeys_and_gives_back_offs(redis_server: RedisServer) -> None:
    async def main() -> None:
        sem = AsyncSemaphore(redis_server.url, limit=Adaptive(2, max=4))
        try:
            async with sem.hold("k"):
                pass  # ended well on a key that was not saturated: no change
            assert await sem.admin.feedback("k") is None
            slot = await sem.acquire("k")
            assert slot is not None
            assert await slot.back_off(1) > 0
            assert await sem.acquire("k") is None
            feedback = await sem.admin.feedback("k")
            assert feedback is not None
            assert feedback.limit == 1
        finally:
            await close(sem.client)

    asyncio.run(main())


def test_a_waiting_acquire_in_another_thread_is_held_back_by_the_cool_down(
    make_semaphore: type[Semaphore],
) -> None:
    sem = make_semaphore(limit=1)
    slot = sem.acquire("k")
    assert slot is not None
    got: list[float] = []
    waiter = threading.Thread(
        target=lambda: got.append(_store_now(sem) if sem.acquire("k", wait=10.0) else 0.0)
    )
    waiter.start()
    ends = slot.back_off(1.0)
    waiter.join(15)
    assert got
    assert got[0] >= ends


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), (0, 0.0), (2.5, 2.5), ("7", 7.0), (b" 3 ", 3.0),
     ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0)],
)  # fmt: skip
def test_retry_after_reads_seconds_and_http_dates(value: object, seconds: float | None) -> None:
    assert retry_after_seconds(value) == seconds


def test_retry_after_reads_an_http_date_in_the_future() -> None:
    found = retry_after_seconds(email.utils.formatdate(time.time() + 30, usegmt=True))
    assert found is not None
    assert 25 < found <= 31


@pytest.mark.parametrize("value", [-1, "soon", float("nan"), float("inf"), True, [1]])
def test_a_bad_hint_is_refused_before_anything_is_written(
    make_semaphore: type[Semaphore], value: object
) -> None:
    with pytest.raises(SemaphoreValidationError, match="retry_after"):
        BackOff(value)
    sem = make_semaphore(limit=1)
    slot = sem.acquire("k")
    assert slot is not None
    with pytest.raises(SemaphoreValidationError, match="retry_after"):
        slot.back_off(value)
    assert not slot.released
    assert sem.admin.feedback("k") is None
    assert slot.release()


@pytest.mark.parametrize(
    "kwargs",
    [{"initial": 0, "max": 4}, {"initial": 5, "max": 4}, {"initial": 2, "min": 3, "max": 4},
     {"initial": 2, "max": 4.5}, {"initial": True, "max": 4}],
)  # fmt: skip
def test_a_bad_adaptive_limit_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(SemaphoreValidationError, match="Adaptive"):
        Adaptive(**kwargs)  # type: ignore[arg-type]


def test_back_off_from_an_error_reads_its_hint_where_clients_put_it() -> None:
    class Response:
        headers: ClassVar[dict[str, str]] = {"Retry-After": "4"}

    class RateLimited(Exception):
        response = Response()

    class WithAttribute(Exception):
        retry_after = 2

    class Garbled(Exception):
        retry_after = "whenever"

    assert BackOff.from_error(RateLimited()).retry_after == 4.0
    assert BackOff.from_error(WithAttribute()).retry_after == 2.0
    assert BackOff.from_error(Garbled()).retry_after is None  # the provider's, not the code's
    assert BackOff.from_error(KeyError()).retry_after is None


def test_a_cool_down_spends_no_units_of_a_start_rate(make_semaphore: type[Semaphore]) -> None:
    """Nothing starts while the key cools down, so no unit of its rate is spent: the
    rate's second unit is still there when the cool-down ends."""
    sem = make_semaphore(limit=5, rate=Rate("1/m", burst=2))
    first = sem.acquire("k")
    assert first is not None
    first.back_off(0.5)
    assert sem.acquire("k") is None  # cooling: refused, and not charged
    assert sem.acquire("k", wait=10.0) is not None  # the burst's second unit
    assert sem.acquire("k") is None  # and now the rate holds it back for a minute
