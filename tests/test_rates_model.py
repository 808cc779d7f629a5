"""A start rate checked against its definition, on a real Redis: random sequences of parks,
claims, releases, sweeps, waits and server freezes on a key with a rate, and after each
sequence every grant the store made (a slot taken in person, at the script's instant, or a
hand-off's start instant) conforms: over any span of D ms, at most ``burst + D / interval``
units. A grant is where a start stands on the store's clock; the run starts there or later.
Restarts are among the steps: a store without persistence forgets the rate's state (as it
forgets the slots), so each incarnation of the store is checked on its own, and the rate
must work on in the next."""

from __future__ import annotations

import itertools
import time

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_semaphore import Rate, Semaphore, Slot
from celery_semaphore.core.names import redis_keys
from celery_semaphore.testing import RedisServer

from .helpers import Published

RATE = Rate("25/s", burst=3)  # one unit every 40 ms
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("park"), st.integers(1, 3)),
        st.tuples(st.just("claim"), st.integers(0, 31)),
        st.tuples(st.just("release"), st.integers(0, 31)),
        st.tuples(st.just("sweep"), st.just(0)),
        st.tuples(st.just("sleep"), st.sampled_from((0, 15, 45, 130))),
        st.tuples(st.just("freeze"), st.sampled_from((30, 120))),
        st.tuples(st.just("restart"), st.just(0)),
    ),
    min_size=4,
    max_size=28,
)


def conforms(grants: list[tuple[float, int]], rate: Rate) -> str | None:
    """None when the grants keep to ``rate``; else the span that passes it."""
    grants = sorted(grants)
    for i, j in itertools.combinations_with_replacement(range(len(grants)), 2):
        units = sum(u for _, u in grants[i : j + 1])
        span = grants[j][0] - grants[i][0]
        if units > rate.burst + span / rate.interval_ms + 1e-6:
            return f"{units} units over {span:.0f} ms: {grants[i : j + 1]}"
    return None


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=OPS)
def test_every_grant_keeps_to_the_rate(
    redis_server: RedisServer, ops: list[tuple[str, int]]
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    published = Published()
    sem = Semaphore(client, limit=3, lease=5.0, on_handoff=published, handoff_grace=0.05)
    units: dict[str, int] = {}
    grants: list[tuple[float, int]] = []
    incarnations = [grants]
    held: list[Slot] = []
    seen = 0
    try:
        for op, arg in ops:
            if op == "park":
                waiter = f"w{len(units)}"
                units[waiter] = arg
                got = sem.room.park("k", waiter, b"p", rates=RATE, units={"requests": arg})
                if isinstance(got, Slot):
                    grants.append((got.acquired_at * 1000, arg))
                    held.append(got)
            elif op == "claim" and published.made:
                handoff = published.made[arg % len(published.made)]
                got = sem.room.claim("k", handoff.waiter)
                if isinstance(got, Slot):
                    held.append(got)
            elif op == "release" and held:
                held.pop(arg % len(held)).release()
            elif op == "sweep":
                sem.room.sweep("k")
            elif op == "sleep":
                time.sleep(arg / 1000)
            elif op == "freeze":
                redis_server.pause()
                time.sleep(arg / 1000)
                redis_server.resume()
            elif op == "restart":
                redis_server.restart()
                held.clear()  # their slots went with the store
                grants = []
                incarnations.append(grants)
            # Each hand-off is a grant at its start instant, or, one free at once, at the
            # instant its reservation was made (its holder record says). One that lapses and
            # is handed again takes units again: counted again.
            for handoff in published.made[seen:]:
                at = handoff.start_ms or _reserved_at(client, handoff.waiter)
                grants.append((at, units[handoff.waiter]))
            seen = len(published.made)
        for each in incarnations:
            assert conforms(each, RATE) is None, (conforms(each, RATE), ops)
    finally:
        for slot in held:
            slot.release()
        client.close()


def _reserved_at(client: redis.Redis, waiter: str) -> float:
    """When the reservation for ``waiter`` was made, epoch ms by the store's clock."""
    record = client.hget(redis_keys("semaphore", "k").holders, f"~{waiter}")
    assert record is not None, f"no reservation for {waiter}"
    return float(record.split(b"|", 1)[0])
