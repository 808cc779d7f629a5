"""When a waiting room is next swept (issue 23): a still room only once per a quarter of its
TTL, and everything its sweep could not see brings the sweep on by itself, even when the
process that caused it dies right after its script ran (real Redis).

A crash is made where it matters most: the release's script has run (the slot is reserved
for the oldest waiter), and nothing after it does (no mark written, no hand-off published),
by a route whose ``deliver`` raises a ``BaseException`` that nothing in the library catches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import redis

from celery_semaphore import Semaphore
from celery_semaphore.core.handoff import SWEPT_WITHIN
from celery_semaphore.core.replies import Handoff, Parked
from celery_semaphore.testing import RedisServer

from .helpers import Published, wait_for

TTL = 400.0  # the rooms' TTL: a still room is swept again 100 s on (less up to a quarter)


class Died(BaseException):
    """The releasing process, gone the instant its script answered."""


@pytest.fixture
def sem(redis_server: RedisServer, published: Published) -> Iterator[Semaphore]:
    semaphore = Semaphore(redis_server.url, limit=1, claim_timeout=1.0, on_handoff=published)
    yield semaphore
    semaphore.client.close()


def _due_in(sem: Semaphore, client: redis.Redis, key: str = "k") -> float:
    """Seconds until ``key``'s room is due for a sweep, by the store's clock."""
    score = client.zscore(sem.room.index.key, key)
    assert score is not None
    seconds, micros = client.time()
    return float(score) / 1000 - (seconds + micros / 1e6)


def _fleet_sweeps(sem: Semaphore) -> int:
    """What a worker's upkeep does once: take the rooms due, sweep them, score them."""
    due = sem.room.index.due(interval=0.2, count=100, ttl=3600.0)
    return sem.room.sweep_many(due.keys, taken_ms=due.taken_ms)


def _still_room(sem: Semaphore, client: redis.Redis, lease: float) -> None:
    """Key "k" full (a holder leased for ``lease`` s) with two runs parked, swept once: its
    room is scored far ahead (a quarter TTL, or the holder's lease end)."""
    for waiter in ("first", "second"):
        assert isinstance(sem.room.park("k", waiter, b"p", room_ttl=TTL), Parked)
    assert _fleet_sweeps(sem) == 0
    assert _due_in(sem, client) > min(lease, TTL / 4) * 0.5


def test_a_still_room_is_swept_a_quarter_of_its_ttl_on(sem: Semaphore, client: redis.Redis) -> None:
    holder = sem.acquire("k", lease=3600.0)
    assert holder is not None
    assert isinstance(sem.room.park("k", "w", b"p", room_ttl=TTL), Parked)
    assert _fleet_sweeps(sem) == 0
    assert TTL / 4 * 0.74 <= _due_in(sem, client) <= TTL / 4 + 1  # not the claim timeout
    assert client.hget(sem.room.names.keys_of("k").parked, "!due") is not None
    assert holder.release()  # a reservation: the room is due when it lapses (1 s)
    assert _due_in(sem, client) <= 1.5
    assert sem.room.cancel("k", "w")


def test_a_sweep_keeps_a_mark_written_since_its_room_was_taken(
    sem: Semaphore, client: redis.Redis
) -> None:
    index = sem.room.index
    client.zadd(index.key, {"marked": 10**12, "still": 10**12})
    due = index.due(interval=60.0, count=10, ttl=3600.0)
    assert sorted(due.keys) == ["marked", "still"]
    client.zadd(index.key, {"marked": due.now_ms + 5_000}, xx=True, lt=True)  # a mark, since
    far = due.now_ms + 3_600_000
    index.reschedule([("marked", due.taken_ms, far), ("still", due.taken_ms, far)])
    assert client.zscore(index.key, "marked") == due.now_ms + 5_000  # kept
    assert client.zscore(index.key, "still") == far  # as its sweep said
    index.reschedule([("marked", due.taken_ms, due.now_ms + 1_000)])
    assert client.zscore(index.key, "marked") == due.now_ms + 1_000  # sooner: taken
    index.reschedule([("gone", due.taken_ms, far)])
    assert client.zscore(index.key, "gone") is None  # a room that left stays out


@pytest.mark.parametrize("lease", [3600.0, 3.0])
def test_a_hand_off_lost_with_its_releaser_is_handed_again(
    sem: Semaphore,
    client: redis.Redis,
    published: Published,
    monkeypatch: pytest.MonkeyPatch,
    lease: float,
) -> None:
    """A long lease brings the room's sweep on before its release runs (the room was scored
    for its lease end, an hour away); a lease of at most SWEPT_WITHIN s needs nothing, since
    the room is swept at its lease end, which the room's last sweep saw."""
    holder = sem.acquire("k", lease=lease)
    assert holder is not None
    _still_room(sem, client, lease)

    def dies(key: str, handoffs: Sequence[Handoff], scripts: object = None) -> int:
        raise Died

    monkeypatch.setattr(sem.handoffs, "deliver", dies)
    with pytest.raises(Died):
        holder.release()
    monkeypatch.undo()
    assert published.waiters == []  # never published, and no mark written after the call
    assert lease <= SWEPT_WITHIN or _due_in(sem, client) <= 1.5  # marked before it ran
    # The fleet's sweeps hand "first" its turn again once its reservation lapses (1 s), or
    # once the holder's lease ends (3 s): within a few seconds, not a quarter TTL.
    assert wait_for(lambda: _fleet_sweeps(sem) > 0, timeout=30, interval=0.1)
    assert published.waiters == ["first"]
