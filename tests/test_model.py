"""Random schedules of the core ``Semaphore`` against a real redis-server, checked against the
plain-Python model in ``tests/model.py`` (Hypothesis ``RuleBasedStateMachine``; no Celery).

Rules: acquire (two keys with their own limits of 1-3, leases of 0.25 s or 20 s, weights of
1-3: a weight over the key's limit must be refused before anything is sent), acquire both
keys at once (``acquire_many``, a weight on each, in either order), extend, release; an
operator's live limit set to 1, 2 or 4, or cleared; an operator's force-release of one slot,
of a waiter's reservation, or of a whole key; a burst of new waiters parks (with or without
``max_queued``), or a burst of waiters of both keys (``park_many``, a weight of 1 or 2 on
each), one parks again, claims (``claim_many`` for one of both keys; with a delivery id, maybe
one that claimed before), is cancelled (one of both keys with either key); a sweep; time
passes a little, or until short leases and reservations
(claim timeouts of 0.3 s or 20 s) have surely lapsed. Each key's hand-off grace is 0 (strict
arrival order) or 0.3 s. Faults: the server frozen with SIGSTOP while one or two calls are
made (each must fail with ``SemaphoreBackendError`` within the client's 0.3 s socket
timeout; the server may still run them when it wakes), and a restart without persistence
(everything gone); at most one fault per 10 steps. Before the next step, the process puts
right the calls that got no answer (core/recovery.py), and the model is told what that
published.

The model reasons with time windows: a slot is surely held only until ``sent + lease -
MARGIN`` and surely gone only after ``received + lease + MARGIN`` (MARGIN 0.35 s), and
everything in between is "maybe"; a call with no answer leaves "maybe" slots, reservations
and waiters behind, up to when the server was surely answering again.

Invariants, after every step: the units the model says are surely held never exceed a key's
limit (after a live limit is lowered, the limit of the grants still live, since lowering
evicts nobody), and neither do ``count`` nor ``holders``; an acquire is granted only if
every key it names had room for its weight under the limit in effect, and refused only if
some key may have had none (all keys or none); a group whose slot is found gone is lost; a
raised limit hands what it frees to the oldest waiters; ``count``, ``available`` and
``holders`` agree with the model within its maybe-window, and a slot or reservation it says
is surely gone is never listed; extend and release answers match it (a surely-held slot is
owned, a surely-gone one is not); a waiter is handed off only while it waits (never again
while its reservation is live, never after it claimed, was cancelled or was refused), in
arrival order, with its latest payload, and a release, cancel, park or sweep that frees a
slot hands it to a waiter that surely waits (the one exception to the order: a waiter that
parks in person may take a reservation unclaimed past the grace, and must when one surely
is); a claim is told "again" exactly when its delivery claimed before; nobody is lost (every
waiter that waits is in the parked hash, and the room, read with ``SemaphoreAdmin.room``,
holds every surely-parked waiter, in arrival order; after a sweep, every waiter whose
reservation lapsed is back in the room); every key in Redis has a TTL, and a key's slots and
holders outlive its live leases. A waiter of both keys (issue 22): while it waits, what it
holds of each key is "maybe" (the rooms reserve, keep and give back its units unseen); it is
handed off, or takes its slots, only holding every key, so never while an older waiter has
been in one of its rooms since before it parked; when handed off, both keys list its
reservation; a claim while they are surely live takes both; a cancel with either key takes it
out of every room; it is in the parked hash of each key while it waits, and in the order of
one room at least (or reserved, or about to be put back by a sweep): never passive in every
room.

Run it:

    .venv/bin/pytest tests/test_model.py -q           # CI profile: fixed examples, about a minute
    CELERY_SEMAPHORE_MODEL=deep .venv/bin/pytest tests/test_model.py -q -k random
                                                       # 400 random examples, about 10 minutes

``CELERY_SEMAPHORE_MODEL_EXAMPLES=N`` sets the deep profile's number of examples. A failure
prints the steps, each with a note of what it was answered and how long it took; the deep
profile also prints a ``@reproduce_failure`` blob to replay it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import pytest
import redis
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_semaphore import Semaphore, SemaphoreBackendError, SemaphoreValidationError, Slot
from celery_semaphore.core import recovery
from celery_semaphore.core.admin import SemaphoreAdmin
from celery_semaphore.core.group import SlotGroup
from celery_semaphore.core.names import Keys, Namespace, redis_keys
from celery_semaphore.core.replies import Handoff, NotWaiting, Parked, RoomFull
from celery_semaphore.testing import RedisServer

from .model import Call, Holding, Model, Outcome, State, Waiter

T = TypeVar("T")

KEYS = ("a", "b")
keys = st.sampled_from(("a", "a", "a", "b"))
"""Mostly "a": a key fills up, and its waiters wait, only if it gets most of the calls."""
LEASES = (0.25, 20.0)
"""A short lease, to see slots lapse, and one that outlives any example, to see them held."""
CLAIM_TIMEOUTS = (0.3, 20.0)
SOCKET_TIMEOUT = 0.3
"""The client's timeout: a call to a frozen server must fail within it (plus SLACK)."""
FAULT_EVERY = 10
"""Steps between two faults (a freeze or a restart), at least."""
SLACK = 2.0
"""Seconds a noisy machine may add to a timeout."""
PREFIX = "model"
WEIGHTS = (1, 1, 2, 3)
"""Mostly plain slots; a weight over a key's limit must be refused before anything is sent."""
GRACES = (0.0, 0.3)
"""Hand-off graces: strict arrival order, or a reservation unclaimed for 0.3 s goes to a
waiter that parks in person."""

settings.register_profile(
    "model-ci",
    max_examples=30,
    stateful_step_count=40,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "model-deep",
    max_examples=int(os.environ.get("CELERY_SEMAPHORE_MODEL_EXAMPLES", "400")),
    stateful_step_count=60,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
DEEP = os.environ.get("CELERY_SEMAPHORE_MODEL", "") == "deep"


class GatherFailures(logging.Handler):
    """Counts the gathers that got no answer (logged by the hand-off route): the waiter of
    several keys it was for may then sit reserved, out of every room's order, until its
    reservation lapses, which the model must know."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "could not gather" in str(record.msg):
            self.count += 1


class Published:
    """The semaphores' ``on_handoff``: collects what each call hands off."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Handoff]] = []

    def __call__(self, key: str, handoffs: Sequence[Handoff]) -> None:
        self.log.extend((key, h) for h in handoffs)

    def take(self, key: str) -> list[tuple[str, bytes]]:
        """What the last call published, all for ``key``; no give-ups (no deadlines here)."""
        by_key = self.take_all()
        assert set(by_key) <= {key}, f"a call on {key!r} published for {sorted(by_key)}"
        return by_key.get(key, [])

    def take_all(self) -> dict[str, list[tuple[str, bytes]]]:
        """What the last call published, by key."""
        items, self.log = self.log, []
        by_key: dict[str, list[tuple[str, bytes]]] = {}
        for published_key, h in items:
            assert not h.give_up, f"a give-up for {h.waiter} though no waiter has a deadline"
            by_key.setdefault(published_key, []).append((h.waiter, h.payload))
        return by_key


def outcome_of(result: object) -> Outcome:
    if isinstance(result, (Slot, SlotGroup)):
        return Outcome("slot", token=result.token)
    if isinstance(result, Parked):
        return Outcome("parked", position=result.position)
    if isinstance(result, RoomFull):
        return Outcome("full")
    assert isinstance(result, NotWaiting), f"park or claim answered {result!r}"
    return Outcome("not waiting", again=result.again)


def say(text: str) -> None:
    """Hypothesis's ``note``, which prints with a failing example's steps (and nothing when
    the machine is driven by hand, as the regression tests do)."""
    with contextlib.suppress(InvalidArgument):
        note(text)


def count(what: str) -> None:
    """Hypothesis's ``event``: how often something happened, in ``--hypothesis-show-statistics``."""
    with contextlib.suppress(InvalidArgument):
        event(what)


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def timed_out(exc: BaseException) -> bool:
    return isinstance(exc.__cause__ or exc, redis.TimeoutError)


class SemaphoreMachine(RuleBasedStateMachine):
    """Calls on two keys of one server, checked against :class:`Model` after every step."""

    def __init__(self, server: RedisServer) -> None:
        super().__init__()
        self.server = server
        self.client = server.client(
            socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT
        )
        self.client.flushall()
        self.published = Published()
        self.operator = SemaphoreAdmin(self.client, PREFIX)  # no publisher: hands off nothing
        self.sems: dict[str, Semaphore] = {}
        self.slots: dict[str, Slot] = {}
        self.groups: dict[str, SlotGroup] = {}
        self.model = Model({}, {})
        self.ready = False
        self.paused = False
        self.last_arrival = 0.0
        self.parks = 0
        self.steps = 0
        self.last_fault = 0
        self.gathers = GatherFailures()
        for name in ("celery_semaphore.core.handoff", "celery_semaphore.asyncio.slot"):
            logging.getLogger(name).addHandler(self.gathers)
        # Lost calls are put right before the next step (see _settle): soon after the server
        # wakes, not up to seconds later.
        self.backoff = recovery.FIRST_TRY, recovery.MAX_BACKOFF
        recovery.FIRST_TRY, recovery.MAX_BACKOFF = 0.05, 0.1

    @initialize(
        limits=st.tuples(st.integers(1, 3), st.integers(1, 3)),
        claims=st.tuples(st.sampled_from(CLAIM_TIMEOUTS), st.sampled_from(CLAIM_TIMEOUTS)),
        graces=st.tuples(st.sampled_from(GRACES), st.sampled_from(GRACES)),
    )
    def setup(
        self,
        limits: tuple[int, int],
        claims: tuple[float, float],
        graces: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        for key, limit, claim, grace in zip(KEYS, limits, claims, graces, strict=True):
            self.sems[key] = Semaphore(
                self.client, limit=limit, lease=LEASES[-1], prefix=PREFIX,
                claim_timeout=claim, on_handoff=self.published, handoff_grace=grace,
            )  # fmt: skip
        self.model = Model(
            dict(zip(KEYS, limits, strict=True)),
            dict(zip(KEYS, claims, strict=True)),
            dict(zip(KEYS, graces, strict=True)),
        )
        self.ready = True

    def teardown(self) -> None:
        if self.paused:
            self.server.resume()
        self.client.close()
        for name in ("celery_semaphore.core.handoff", "celery_semaphore.asyncio.slot"):
            logging.getLogger(name).removeHandler(self.gathers)
        recovery.FIRST_TRY, recovery.MAX_BACKOFF = self.backoff

    # -- helpers ------------------------------------------------------------------------

    def _run(self, fn: Callable[[], T]) -> tuple[Call, T | None, bool]:
        """Call ``fn``: its timing, its answer, and whether it got one. A timeout on a busy
        machine is a call with no answer, as when the server is frozen."""
        sent = time.monotonic()
        failed = self.gathers.count
        try:
            value = fn()
        except SemaphoreBackendError as exc:
            if not timed_out(exc):
                raise
            count("a call timed out with the server running")
            return Call(sent, time.monotonic()), None, False
        finally:
            if self.gathers.count != failed:
                count("a gather timed out")
                self.model.blur_many()
        return Call(sent, time.monotonic()), value, True

    def _lost(self, op: str, call: Call, **kw: object) -> None:
        say(f"{op} got no answer in {call.received - call.sent:.3f}s")
        self.model.unanswered(op, call, **kw)
        self._settle()

    def _settle(self) -> None:
        """Wait until the server answers again and this process has put right the calls that
        got no answer (core/recovery.py), and tell the model, with what that published."""
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.ping()
                break
            except redis.RedisError:
                assert time.monotonic() < deadline, "the server did not answer for 30 s"
                time.sleep(0.05)
        while not recovery.idle():
            assert time.monotonic() < deadline, "lost calls were not put right within 30 s"
            time.sleep(0.05)
        at = time.monotonic()
        self.model.settle(at)
        recovered = [h for handed in self.published.take_all().values() for h in handed]
        if recovered:
            say(f"the recovery of calls with no answer published {recovered}")
            self.model.recovered(recovered, at)

    def _arrival(self) -> float:
        self.last_arrival = max(time.time(), self.last_arrival + 0.002)
        return self.last_arrival

    # Rules have no preconditions on what the model holds: that depends on timing, and
    # Hypothesis needs the same draws to enable the same rules. With nothing to pick, a rule
    # does nothing.

    def _pick_holding(self, pick: int) -> Holding | None:
        """The slot ``pick`` points at, newest first: one not released yet (a released Slot
        answers without a round trip), or, for every fourth pick, any."""
        holdings = self.model.holdings
        if pick % 4 != 3:
            holdings = [h for h in holdings if h.released is None] or holdings
        return holdings[-1 - (pick // 4) % len(holdings)] if holdings else None

    def _pick_waiter(self, pick: int, sure: bool = False) -> Waiter | None:
        """The waiter ``pick`` points at, newest first: one still waiting, or, for every
        fourth pick, any (``sure``: not one the model is unsure of)."""
        waiters = [
            w for w in self.model.waiters.values() if not sure or w.state is not State.UNSURE
        ]
        if pick % 4 != 3:
            waiters = [w for w in waiters if w.state is not State.DONE] or waiters
        return waiters[-1 - (pick // 4) % len(waiters)] if waiters else None

    # -- slots --------------------------------------------------------------------------

    def _refused(self, what: str, fn: Callable[[], object]) -> None:
        """A call with a bad argument: it must raise before anything is sent (the invariants
        after the step see that nothing changed)."""
        with pytest.raises(SemaphoreValidationError) as raised:
            fn()
        assert not self.published.log, f"{what} with a bad argument published hand-offs"
        say(f"{what} refused: {raised.value}")

    @rule(key=keys, lease=st.sampled_from(LEASES), weight=st.sampled_from(WEIGHTS))
    def acquire(self, key: str, lease: float, weight: int = 1) -> None:
        sem = self.sems[key]
        if weight > sem.limit:
            return self._refused(
                f"acquire of {key!r} weight {weight}", lambda: sem.acquire(key, weight=weight)
            )
        call, slot, answered = self._run(lambda: sem.acquire(key, lease=lease, weight=weight))
        if not answered:
            return self._lost("acquire", call, key=key, lease=lease, weight=weight)
        handoffs = self.published.take(key)
        token = slot.token if slot else None
        h = self.model.acquire(key, call, lease, token, handoffs, weight)
        say(f"acquire {key!r} weight {weight} -> {h} in {call.received - call.sent:.3f}s, "
            f"handed {handoffs}")  # fmt: skip
        if slot is not None and h is not None:
            assert (slot.key, slot.limit, slot.lease, slot.weight) == (
                key, self.model.keys[key].limit, lease, weight)  # fmt: skip
            self.slots[h.name] = slot

    @rule(
        weights=st.tuples(st.sampled_from(WEIGHTS), st.sampled_from(WEIGHTS)),
        lease=st.sampled_from(LEASES),
        reverse=st.booleans(),
    )
    def acquire_many(self, weights: tuple[int, int], lease: float, reverse: bool) -> None:
        """One run takes a slot of both keys, with a weight on each, all or nothing."""
        specs = [(key, self.sems[key].limit, w) for key, w in zip(KEYS, weights, strict=True)]
        specs = specs[::-1] if reverse else specs
        sem = self.sems[specs[0][0]]
        if any(w > limit for _, limit, w in specs):
            return self._refused(f"acquire_many {specs}", lambda: sem.acquire_many(specs))
        call, group, answered = self._run(lambda: sem.acquire_many(specs, lease=lease))
        pairs = [(key, w) for key, _, w in specs]
        if not answered:
            for key, w in pairs:
                self.model.unanswered("acquire", call, key=key, lease=lease, weight=w)
            return self._lost("acquire_many", call, key=specs[0][0], lease=lease)
        handoffs = self.published.take_all()
        token = group.token if group else None
        held = self.model.acquire_many(pairs, call, lease, token, handoffs)
        say(f"acquire_many {pairs} -> {held} in {call.received - call.sent:.3f}s, "
            f"handed {handoffs}")  # fmt: skip
        if group is not None and held:
            assert group.keys == [key for key, _ in pairs]
            for h, slot in zip(held, group.slots, strict=True):
                assert (slot.limit, slot.weight) == (self.model.keys[h.key].limit, h.weight)
                self.slots[h.name] = slot
                self.groups[h.name] = group

    @rule(key=keys, limit=st.sampled_from((None, 1, 2, 4)))
    def set_limit(self, key: str, limit: int | None) -> None:
        """An operator sets (or clears) the key's live limit: a raise hands out slots."""
        call, _, answered = self._run(
            lambda: self.sems[key].admin.set_limit(key, limit, by="model")
        )
        if not answered:  # it may have handed off unpublished: send it again, which lands
            self._lost("set_limit", call, key=key)
            call, _, answered = self._run(
                lambda: self.sems[key].admin.set_limit(key, limit, by="model")
            )
            assert answered, "set_limit timed out twice on a running server"
        handoffs = self.published.take(key)
        say(f"set_limit {key!r} {limit} -> handed {handoffs}")
        self.model.set_limit(key, call, limit, handoffs)

    @rule(pick=st.integers(0, 63), lease=st.sampled_from(LEASES))
    def extend(self, pick: int, lease: float) -> None:
        h = self._pick_holding(pick)
        if h is None:
            return
        slot = self.slots[h.name]
        call, answer, answered = self._run(lambda: slot.extend(lease))
        if not answered:
            return self._lost("extend", call, key=h.key, holding=h, lease=lease)
        say(f"extend {h} for {lease}s -> {answer}")
        assert answer is not None
        if not answer and h.released is None:
            assert slot.lost.is_set(), f"extend found {h} gone but did not mark it lost"
            if h.group:
                assert self.groups[h.name].lost.is_set(), f"{h} was lost but not its group"
        self.model.extend(h, call, lease, answer)

    @rule(pick=st.integers(0, 63))
    def release(self, pick: int) -> None:
        h = self._pick_holding(pick)
        if h is None:
            return
        slot = self.slots[h.name]
        call, answer, answered = self._run(slot.release)
        if not answered:
            return self._lost("release", call, key=h.key, holding=h)
        handoffs = self.published.take(h.key)
        say(f"release {h} -> {answer}, handed {handoffs}")
        assert answer is not None
        if not answer:
            assert slot.lost.is_set(), f"release found {h} gone but did not mark it lost"
        self.model.release(h, call, answer, handoffs)

    @rule(pick=st.integers(0, 63), what=st.sampled_from(("slot", "reservation", "key")))
    def force_release(self, pick: int, what: str) -> None:
        """An operator frees one slot by its token (a holder's, or a waiter's reservation
        ``~<waiter>`` as ``holders`` lists it), or every slot of a key."""
        h = self._pick_holding(pick)
        w = self._pick_waiter(pick)
        if what == "key":
            key = h.key if h is not None else KEYS[pick % len(KEYS)]
            call, displaced, answered = self._run(lambda: self.operator.force_release_all(key))
            if not answered:
                return self._lost("force_release_all", call, key=key)
            say(f"force_release_all {key!r} -> {displaced}")
            assert displaced is not None
            return self.model.force_release_all(key, call, displaced)
        if what == "reservation" and w is not None:
            key = KEYS[pick % len(KEYS)] if w.many else w.key
            call, answer, answered = self._run(
                lambda: self.operator.force_release(key, f"~{w.name}")
            )
            if not answered:
                return self._lost("force_release", call, key=key, waiter=w)
            say(f"force_release of the reservation of {w} on {key!r} -> {answer}")
            assert answer is not None
            return self.model.force_release_reservation(w.name, call, answer, key)
        if h is None:
            return
        call, answer, answered = self._run(lambda: self.operator.force_release(h.key, h.token))
        if not answered:
            return self._lost("force_release", call, key=h.key, holding=h)
        say(f"force_release {h} -> {answer}")
        assert answer is not None
        self.model.force_release(h, call, answer)

    # -- the waiting room ---------------------------------------------------------------

    def _park(
        self, key: str, name: str, lease: float, max_queued: int, payload: bytes, lazy: bool
    ) -> None:
        arrival = self._arrival()
        # A payload given as a function is made only to park: on a key its semaphore last saw
        # with no room, a free slot is first taken without it (park.lua's take mode).
        given: bytes | Callable[[], bytes] = (lambda: payload) if lazy else payload
        call, result, answered = self._run(
            lambda: self.sems[key].room.park(
                key, name, given, arrival=arrival, lease=lease, max_queued=max_queued
            )
        )
        old = self.model.waiters.get(name)
        if not answered:
            if old is not None and old.state is not State.DONE:
                old.payloads.add(payload)
                waiter = old
            else:
                waiter = Waiter(name, key, arrival, {payload}, State.UNSURE)
            return self._lost("park", call, key=key, waiter=waiter, lease=lease)
        handoffs = self.published.take(key)
        outcome = outcome_of(result)
        say(f"park {name} on {key!r} -> {outcome}, handed {handoffs}")
        h = self.model.park(key, name, payload, arrival, lease, max_queued, call, outcome, handoffs)
        if h is not None:
            assert isinstance(result, Slot)
            self.slots[h.name] = result

    @rule(
        key=keys,
        runs=st.integers(1, 3),
        lease=st.sampled_from(LEASES),
        max_queued=st.sampled_from((0, 0, 2)),
        lazy=st.booleans(),
    )
    def park(self, key: str, runs: int, lease: float, max_queued: int, lazy: bool = False) -> None:
        """A burst of ``runs`` new waiters parks, one call each: the first take the free
        slots, the rest wait."""
        for _ in range(runs):
            name = f"w{self.parks}"
            self.parks += 1
            self._park(key, name, lease, max_queued, f"{name}/0".encode(), lazy)

    def _many(self, needs: dict[str, int]) -> list[tuple[str, int, int]]:
        return [(key, self.sems[key].limit, weight) for key, weight in needs.items()]

    def _park_many(self, name: str, needs: dict[str, int], lease: float, payload: bytes) -> None:
        specs = self._many(needs)
        sem = self.sems[KEYS[0]]  # what this call reserves lives for its claim timeout
        if any(weight > limit for _, limit, weight in specs):
            refused = functools.partial(sem.room.park_many, specs, name, payload)
            return self._refused(f"park_many {specs}", refused)
        arrival = self._arrival()
        call, result, answered = self._run(
            lambda: sem.room.park_many(specs, name, payload, arrival=arrival, lease=lease)
        )
        old = self.model.waiters.get(name)
        if not answered:
            if old is not None and old.state is not State.DONE:
                old.payloads.add(payload)
                waiter = old
            else:
                waiter = Waiter(name, KEYS[0], arrival, {payload}, State.UNSURE, needs=needs,
                                since=call.sent)  # fmt: skip
                waiter.unknown_holds(self.model.limits)
            return self._lost("park", call, key=KEYS[0], waiter=waiter, lease=lease)
        handoffs = self.published.take("+".join(needs))
        outcome = outcome_of(result)
        say(f"park_many {name} on {needs} -> {outcome}, handed {handoffs}")
        held = self.model.park_many(name, needs, payload, arrival, lease, call, outcome,
                                    handoffs, KEYS[0])  # fmt: skip
        self._keep_group(held, result)

    def _keep_group(self, held: list[Holding] | None, result: object) -> None:
        if held:
            assert isinstance(result, SlotGroup)
            for h, slot in zip(held, result.slots, strict=True):
                self.slots[h.name] = slot
                self.groups[h.name] = result

    @rule(
        runs=st.integers(1, 2),
        weights=st.tuples(st.sampled_from((1, 1, 2)), st.sampled_from((1, 1, 2))),
        lease=st.sampled_from(LEASES),
    )
    def park_many(self, runs: int, weights: tuple[int, int], lease: float) -> None:
        """A burst of ``runs`` new waiters of both keys parks (park_many), one call each."""
        for _ in range(runs):
            name = f"w{self.parks}"
            self.parks += 1
            self._park_many(name, dict(zip(KEYS, weights, strict=True)), lease,
                            f"{name}/0".encode())  # fmt: skip

    @rule(pick=st.integers(0, 63), lease=st.sampled_from(LEASES), lazy=st.booleans())
    def park_again(self, pick: int, lease: float, lazy: bool = False) -> None:
        w = self._pick_waiter(pick, sure=True)
        if w is None:
            return
        self.parks += 1
        payload = f"{w.name}/{self.parks}".encode()
        if w.many:
            return self._park_many(w.name, w.needs, lease, payload)
        self._park(w.key, w.name, lease, 0, payload, lazy)

    @rule(
        pick=st.integers(0, 63),
        lease=st.sampled_from(LEASES),
        delivery=st.sampled_from(("", "m1", "m2")),
    )
    def claim(self, pick: int, lease: float, delivery: str = "") -> None:
        """A waiter's run starts and claims, with the id of the message it came in ("": none;
        the same id again: the broker delivered that message again)."""
        w = self._pick_waiter(pick)
        if w is None:
            return
        if w.many:
            return self._claim_many(w, lease, delivery)
        call, result, answered = self._run(
            lambda: self.sems[w.key].room.claim(w.key, w.name, lease=lease, delivery=delivery)
        )
        if not answered:
            return self._lost("claim", call, key=w.key, waiter=w, lease=lease, delivery=delivery)
        handoffs = self.published.take(w.key)
        outcome = outcome_of(result)
        say(f"claim {w} by {delivery!r} -> {outcome}, handed {handoffs}")
        h = self.model.claim(w.name, call, lease, outcome, handoffs, delivery)
        if h is not None:
            assert isinstance(result, Slot)
            self.slots[h.name] = result

    def _claim_many(self, w: Waiter, lease: float, delivery: str) -> None:
        room = self.sems[w.key].room
        call, result, answered = self._run(
            lambda: room.claim_many(self._many(w.needs), w.name, lease=lease, delivery=delivery)
        )
        if not answered:
            return self._lost("claim", call, key=w.key, waiter=w, lease=lease, delivery=delivery)
        handoffs = self.published.take("+".join(w.needs))
        outcome = outcome_of(result)
        say(f"claim_many {w} by {delivery!r} -> {outcome}, handed {handoffs}")
        held = self.model.claim_many(w.name, call, lease, outcome, handoffs, w.key, delivery)
        self._keep_group(held, result)

    @rule(pick=st.integers(0, 63))
    def cancel(self, pick: int) -> None:
        w = self._pick_waiter(pick)
        if w is None:
            return
        key = KEYS[pick % len(KEYS)] if w.many else w.key  # either of its keys takes it out
        call, found, answered = self._run(lambda: self.sems[key].room.cancel(key, w.name))
        if not answered:
            return self._lost("cancel", call, key=key, waiter=w)
        handoffs = self.published.take(key)
        say(f"cancel {w} on {key!r} -> {found}, handed {handoffs}")
        assert found is not None
        self.model.cancel(w.name, call, found, handoffs, key)

    @rule(key=keys)
    def sweep(self, key: str) -> None:
        call, handed, answered = self._run(lambda: self.sems[key].room.sweep(key))
        if not answered:
            return self._lost("sweep", call, key=key)
        handoffs = self.published.take(key)
        say(f"sweep {key!r} -> {handed}, handed {handoffs}")
        assert handed is not None
        self.model.sweep(key, call, handed, handoffs)

    # -- time and faults ----------------------------------------------------------------

    def _lapsing(self) -> list[float]:
        """When each window that ends within 1.5 s is surely gone."""
        now = time.monotonic()
        return [
            win.gone_after
            for km in self.model.keys.values()
            for _, win in km.windows()
            if now < win.gone_after <= now + 1.5
        ]

    @rule(wait=st.sampled_from(("a little", "a while", "past the short leases")))
    def time_passes(self, wait: str) -> None:
        """Sleep 0.05 s or 0.2 s, or until every short lease and reservation surely lapsed."""
        seconds = {"a little": 0.05, "a while": 0.2}.get(wait)
        if seconds is None:
            seconds = max(self._lapsing(), default=0.0) + 0.02 - time.monotonic()
        time.sleep(max(0.0, seconds))

    def _frozen_call(self, op: str, key: str, pick: int) -> None:
        """One call to the frozen server: it must fail within the client's timeout."""
        sem = self.sems[key]
        lease = LEASES[pick % len(LEASES)]
        kw: dict[str, object] = {"key": key, "lease": lease}
        fn: Callable[[], object]
        h = self._pick_holding(pick)
        w = self._pick_waiter(pick)
        if op in ("extend", "release") and h is not None:
            slot = self.slots[h.name]
            if h.released is None:  # else the slot answers without a round trip
                kw.update(key=h.key, holding=h)
                fn = (lambda: slot.extend(lease)) if op == "extend" else slot.release
            else:
                op, fn = "count", lambda: sem.count(key)
        elif op in ("claim", "cancel") and w is not None:
            kw.update(key=w.key, waiter=w)
            room = self.sems[w.key].room
            fn = (
                (lambda: room.claim(w.key, w.name, lease=lease))
                if op == "claim"
                else (lambda: room.cancel(w.key, w.name))
            )
            if op == "claim" and w.many:
                fn = lambda: room.claim_many(self._many(w.needs), w.name, lease=lease)  # noqa: E731
        elif op == "sweep":
            fn = lambda: sem.room.sweep(key)  # noqa: E731
        elif op == "acquire_many":
            specs = [(k, self.sems[k].limit, 1) for k in KEYS]
            fn = lambda: sem.acquire_many(specs, lease=lease)  # noqa: E731
        elif op == "count":
            fn = lambda: sem.count(key)  # noqa: E731
        else:
            weight = min(1 + pick % 2, sem.limit)
            kw["weight"] = weight
            op, fn = "acquire", lambda: sem.acquire(key, lease=lease, weight=weight)
        sent = time.monotonic()
        with pytest.raises(SemaphoreBackendError) as raised:
            fn()
        call = Call(sent, time.monotonic())
        took = call.received - sent
        assert took < SOCKET_TIMEOUT + SLACK, (
            f"{op} on the frozen server took {took:.2f}s to fail; the timeout is {SOCKET_TIMEOUT}s"
        )
        assert timed_out(raised.value), f"{op} on the frozen server failed with {raised.value!r}"
        assert not self.published.log, f"{op} on the frozen server published hand-offs"
        say(f"frozen: {op} {kw.get('holding') or kw.get('waiter') or key} failed in {took:.2f}s")
        if op == "acquire_many":  # a slot of each key, maybe
            for k in KEYS:
                self.model.unanswered("acquire", call, key=k, lease=lease, weight=1)
        elif op != "count":
            self.model.unanswered(op, call, **kw)

    def _fault_allowed(self) -> bool:
        """Faults wipe or blur what the steps before built up: at most one per FAULT_EVERY
        steps (a count of steps, not of time: Hypothesis needs preconditions that depend
        only on the steps drawn)."""
        return self.steps - self.last_fault >= FAULT_EVERY

    @precondition(_fault_allowed)
    @rule(
        ops=st.lists(
            st.tuples(
                st.sampled_from(("acquire", "acquire_many", "extend", "release", "claim",
                                 "cancel", "sweep", "count")),
                keys,
                st.integers(0, 63),
            ),
            min_size=1,
            max_size=2,
        ),
        frozen_for=st.sampled_from((0.0, 0.4)),
    )  # fmt: skip
    def freeze(self, ops: list[tuple[str, str, int]], frozen_for: float) -> None:
        """SIGSTOP the server, make calls that must fail, maybe let leases lapse, SIGCONT."""
        self.last_fault = self.steps
        self.server.pause()
        self.paused = True
        try:
            for op, key, pick in ops:
                self._frozen_call(op, key, pick)
            time.sleep(frozen_for)
        finally:
            self.server.resume()
            self.paused = False
        self._settle()

    @precondition(_fault_allowed)
    @rule()
    def restart(self) -> None:
        """Restart the server without persistence: every slot, reservation and room is gone."""
        self.last_fault = self.steps
        self.server.restart()
        self.client.connection_pool.disconnect()
        self.model.restart(time.monotonic())

    # -- invariants ---------------------------------------------------------------------

    def _read(self, fn: Callable[[], T]) -> tuple[Call, T] | None:
        """A read for a check; None (the check skipped) if it timed out on a busy machine."""
        sent = time.monotonic()
        try:
            value = fn()
        except (SemaphoreBackendError, redis.TimeoutError) as exc:
            if not timed_out(exc):
                raise
            count("a check's read timed out")
            return None
        return Call(sent, time.monotonic()), value

    @invariant()
    def count_steps(self) -> None:
        self.steps += 1

    @invariant()
    def surely_held_within_limits(self) -> None:
        self.model.check_limits(time.monotonic())

    @staticmethod
    def _counts(sem: Semaphore, key: str) -> tuple[int, int]:
        return sem.count(key), sem.available(key)

    @invariant()
    def counts_agree(self) -> None:
        for key, sem in self.sems.items():
            read = self._read(functools.partial(self._counts, sem, key))
            if read is not None:
                call, (count, available) = read
                self.model.observe_count(key, call, count, available)

    @invariant()
    def holders_agree(self) -> None:
        for key, sem in self.sems.items():
            read = self._read(functools.partial(sem.admin.holders, key))
            if read is not None:
                call, holders = read
                rows = [(h.token, str(h.metadata.get("reserved_for", ""))) for h in holders]
                self.model.observe_holders(key, call, rows)

    @invariant()
    def nobody_is_lost(self) -> None:
        rooms: dict[str, list[str]] = {}
        reserved: dict[str, set[str]] = {}
        passive: dict[str, set[str]] = {}
        for key, sem in self.sems.items():
            names = redis_keys(PREFIX, key)

            def look(
                sem: Semaphore = sem, key: str = key, names: Keys = names
            ) -> tuple[list[str], set[str], set[str]]:
                room = [w.waiter for w in sem.room.waiters(key)]
                fields = {text(f) for f in self.client.hkeys(names.parked)}
                members = {text(m) for m in self.client.zrange(names.slots, 0, -1)}
                return room, fields, {m[1:] for m in members if m.startswith("~")}

            read = self._read(look)
            if read is None:
                return
            call, (room, fields, held) = read
            parked = {f for f in fields if not f.startswith("!")}
            self.model.observe_room(key, call, room, parked)
            rooms[key], reserved[key] = room, held
            passive[key] = {f[3:] for f in fields if f.startswith("!p:")}
        self.model.observe_orders(call, rooms, reserved, passive)

    @invariant()
    def rooms_are_due_in_time(self) -> None:
        """The room index never scores a room later than the first reservation lapse or
        deadline in it: whatever made it (a park, a release's hand-off, a cancel, a sweep, a
        force release), the room's sweep comes no later (see sweep.lua's next_ms)."""
        index = Namespace(PREFIX, False).room_index
        for key in KEYS:
            deadlines = redis_keys(PREFIX, key).deadlines
            with self.client.pipeline(transaction=True) as pipe:
                pipe.zscore(index, key)
                pipe.zrange(deadlines, 0, 0, withscores=True)
                score, first = pipe.execute()
            if score is not None and first:
                assert score <= first[0][1], (
                    f"room {key!r} is due for a sweep at {score:.0f}, after its first due "
                    f"item {text(first[0][0])!r} at {first[0][1]:.0f}"
                )

    @invariant()
    def every_key_expires(self) -> None:
        read = self._read(self._ttls)
        if read is None:
            return
        _, (ttls, leases) = read
        # An operator's live limit stays until it is cleared, by design, and so does the
        # record of operators' decisions the workers put back after a restart.
        operators = {redis_keys(PREFIX, key).limits for key in KEYS} | {f"{PREFIX}:decisions"}
        for name, ttl in ttls.items():
            assert ttl != -1 or name in operators, f"Redis key {name!r} has no TTL"
        for name, (ttl, latest) in leases.items():
            assert ttl >= latest - 50, (
                f"Redis key {name!r} expires in {ttl} ms, before its live lease ({latest} ms)"
            )

    def _ttls(self) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
        """PTTL of every key; and for each key's slots and holders, their PTTL and the ms
        until its latest live lease ends (read in one transaction)."""
        ttls = {
            raw.decode() if isinstance(raw, bytes) else str(raw): self.client.pttl(raw)
            for raw in self.client.scan_iter(count=500)
        }
        leases: dict[str, tuple[int, int]] = {}
        for key in KEYS:
            names = redis_keys(PREFIX, key)
            with self.client.pipeline(transaction=True) as pipe:
                pipe.time()
                pipe.pttl(names.slots)
                pipe.pttl(names.holders)
                pipe.zrange(names.slots, 0, -1, withscores=True)
                (seconds, micros), slots_ttl, holders_ttl, members = pipe.execute()
            now_ms = seconds * 1000 + micros // 1000
            if members and members[-1][1] > now_ms:
                leases[names.slots] = (slots_ttl, int(members[-1][1]) - now_ms)
            # The holders hash keeps the records of members that do not carry their own.
            recorded = [score for m, score in members if b"|" not in m and score > now_ms]
            if recorded:
                leases[names.holders] = (holders_ttl, int(max(recorded)) - now_ms)
        return ttls, leases


PROFILE = settings.get_profile("model-deep" if DEEP else "model-ci")


@pytest.mark.timeout(0 if DEEP else 600)
def test_random_schedules_keep_the_invariants() -> None:
    with RedisServer() as server:

        class OnServer(SemaphoreMachine):
            def __init__(self) -> None:
                super().__init__(server)

        run_state_machine_as_test(OnServer, settings=PROFILE)


# -- schedules written out: the interleavings the random search finds rarely --------------

INVARIANTS = (
    "surely_held_within_limits",
    "counts_agree",
    "holders_agree",
    "nobody_is_lost",
    "every_key_expires",
)


class Driven:
    """The machine driven by hand, checking every invariant after each step as Hypothesis
    does; slots and waiters are named as the model names them (``s0``, ``w1``)."""

    def __init__(
        self,
        server: RedisServer,
        limits: tuple[int, int] = (1, 1),
        claims: tuple[float, float] = (20.0, 20.0),
        graces: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.machine = SemaphoreMachine(server)
        self.machine.setup(limits=limits, claims=claims, graces=graces)
        self.model = self.machine.model
        self.check()

    def check(self) -> None:
        self.machine.count_steps()  # invariants, in the order Hypothesis runs them
        for name in INVARIANTS:
            getattr(self.machine, name)()

    def step(self, rule: str, **kwargs: object) -> None:
        getattr(self.machine, rule)(**kwargs)
        self.check()

    def pick(self, name: str) -> int:
        """The ``pick`` that makes a rule choose slot or waiter ``name``."""
        for pick in range(64):
            chosen = (
                self.machine._pick_holding(pick)
                if name.startswith("s")
                else self.machine._pick_waiter(pick)
            )
            if chosen is not None and chosen.name == name:
                return pick
        raise LookupError(name)

    def state(self, waiter: str) -> State:
        return self.model.waiters[waiter].state

    def close(self) -> None:
        self.machine.teardown()


@pytest.fixture
def driven(own_redis: RedisServer) -> Iterator[Callable[..., Driven]]:
    made: list[Driven] = []

    def make(**kwargs: tuple[float, float]) -> Driven:
        made.append(Driven(own_redis, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for d in made:
        d.close()


def test_schedule_a_lapsed_slot_is_never_revived_and_a_sweep_hands_out_a_freed_one(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(2, 1))
    d.step("acquire", key="a", lease=20.0)  # keeps the key alive past s1's lease
    d.step("acquire", key="a", lease=0.25)
    d.step("acquire", key="b", lease=0.25)
    d.step("extend", pick=d.pick("s2"), lease=20.0)  # its keys' TTL must follow
    d.step("time_passes", wait="past the short leases")
    d.step("extend", pick=d.pick("s1"), lease=20.0)  # lapsed but still there: not revived
    d.step("release", pick=d.pick("s1"))  # not owned
    d.step("park", key="a", runs=2, lease=20.0, max_queued=0)  # w0 takes s3, w1 waits
    d.step("force_release", pick=d.pick("s3"), what="slot")  # an operator hands off nothing
    assert d.state("w1") is State.PARKED
    d.step("sweep", key="a")  # must hand the free slot to w1
    assert d.state("w1") is State.RESERVED
    d.step("force_release", pick=d.pick("w1"), what="reservation")
    d.step("sweep", key="a")  # w1 back in the room, and handed the slot again
    assert d.state("w1") is State.RESERVED
    d.step("claim", pick=d.pick("w1"), lease=20.0)
    assert d.state("w1") is State.DONE


def test_schedule_a_release_frees_lapsed_slots_before_it_hands_off(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(1, 1))
    d.step("acquire", key="a", lease=20.0)
    d.step("force_release", pick=d.pick("s0"), what="slot")
    d.step("acquire", key="a", lease=0.25)
    d.step("park", key="a", runs=1, lease=20.0, max_queued=0)
    d.step("time_passes", wait="past the short leases")
    d.step("release", pick=d.pick("s0"))  # not owned, yet s1 lapsed: w0 gets its slot
    assert d.state("w0") is State.RESERVED


def test_schedule_a_sweep_puts_back_a_waiter_a_plain_acquire_orphaned(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(1, 1), claims=(0.3, 20.0))
    d.step("park", key="a", runs=2, lease=20.0, max_queued=0)  # w0 takes the slot, w1 waits
    assert (d.state("w0"), d.state("w1")) == (State.DONE, State.PARKED)
    d.step("release", pick=d.pick("s0"))  # hands the slot to w1 for 0.3 s
    assert d.state("w1") is State.RESERVED
    d.step("time_passes", wait="past the short leases")
    d.step("acquire", key="a", lease=20.0)  # prunes w1's reservation, does not requeue it
    assert d.model.holdings[-1].name == "s1"
    d.step("sweep", key="a")  # w1 back in the room (checked by nobody_is_lost)
    assert d.state("w1") is State.PARKED
    d.step("release", pick=d.pick("s1"))
    assert d.state("w1") is State.RESERVED


def test_schedule_cancel_of_a_reserved_waiter_hands_its_slot_to_the_next(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(1, 2))
    d.step("park", key="a", runs=3, lease=20.0, max_queued=0)
    d.step("release", pick=d.pick("s0"))
    assert [d.state(w) for w in ("w1", "w2")] == [State.RESERVED, State.PARKED]
    d.step("cancel", pick=d.pick("w1"))
    assert [d.state(w) for w in ("w1", "w2")] == [State.DONE, State.RESERVED]
    d.step("claim", pick=d.pick("w2"), lease=20.0, delivery="m1")
    d.step("claim", pick=d.pick("w2"), lease=20.0, delivery="m1")  # redelivered: again
    d.step("claim", pick=d.pick("w2"), lease=20.0, delivery="m2")  # another copy
    assert d.state("w2") is State.DONE
    assert d.model.holdings[-1].name == "s1"
    d.step("claim", pick=d.pick("w1"), lease=20.0)  # cancelled: not waiting
    d.step("park_again", pick=d.pick("w1"), lease=20.0)  # a new arrival, behind nobody
    assert d.state("w1") is State.PARKED


def test_schedule_a_reservation_unclaimed_past_the_grace_goes_to_a_waiter_in_person(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(1, 1), graces=(0.3, 0.0))
    d.step("park", key="a", runs=2, lease=20.0, max_queued=0)  # w0 takes s0, w1 waits
    d.step("release", pick=d.pick("s0"))  # w1's reservation
    for _ in range(4):  # its run is late: the reservation is surely past the grace
        d.step("time_passes", wait="a while")
    d.step("park", key="a", runs=1, lease=20.0, max_queued=0)  # w2 is here: it must take it
    assert d.state("w2") is State.DONE
    d.step("claim", pick=d.pick("w1"), lease=20.0)  # w1's run comes: it waits again
    assert d.state("w1") is State.PARKED
    d.step("release", pick=d.pick("s1"))  # and gets the next slot
    assert d.state("w1") is State.RESERVED


def test_schedule_calls_to_a_frozen_server_fail_and_may_still_run(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(1, 2), claims=(20.0, 0.3))
    d.step("acquire", key="a", lease=20.0)
    d.step("acquire", key="b", lease=0.25)
    d.step("park", key="a", runs=2, lease=20.0, max_queued=0)  # w0, w1 wait behind s0
    d.machine.steps += FAULT_EVERY
    ops = [("release", "a", d.pick("s0")), ("extend", "b", d.pick("s1"))]
    d.step("freeze", ops=ops, frozen_for=0.4)
    # The release ran when the server woke: w0 holds a reservation nobody published.
    assert [d.state(w) for w in ("w0", "w1")] == [State.RESERVED, State.RESERVED]
    d.step("release", pick=d.pick("s0"))  # gone already, or gone now
    d.step("claim", pick=d.pick("w0"), lease=20.0)
    d.step("time_passes", wait="past the short leases")
    d.step("sweep", key="b")
    d.step("acquire", key="b", lease=0.25)


def test_schedule_a_restart_loses_every_slot_and_waiter(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(2, 1))
    d.step("acquire", key="a", lease=20.0)
    d.step("park", key="b", runs=2, lease=20.0, max_queued=0)
    d.machine.steps += FAULT_EVERY
    d.step("restart")
    assert d.state("w1") is State.DONE
    d.step("extend", pick=d.pick("s0"), lease=20.0)  # gone
    d.step("release", pick=d.pick("s1"))  # gone
    d.step("claim", pick=d.pick("w1"), lease=20.0)  # not waiting
    d.step("park", key="b", runs=2, lease=20.0, max_queued=2)


def test_schedule_a_lowered_live_limit_refuses_until_under_it_and_a_raise_hands_off(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(3, 1))
    d.step("acquire", key="a", lease=20.0)
    d.step("acquire", key="a", lease=20.0, weight=2)  # the key is full: 3 units of 3
    d.step("set_limit", key="a", limit=1)  # nobody evicted: 3 held over a limit of 1
    d.step("release", pick=d.pick("s1"))  # 1 unit left: still not under the limit
    d.step("acquire", key="a", lease=20.0)  # refused (the code's limit of 3 would admit it)
    assert len(d.model.holdings) == 2
    d.step("park", key="a", runs=2, lease=20.0, max_queued=0)  # both wait
    assert (d.state("w0"), d.state("w1")) == (State.PARKED, State.PARKED)
    d.step("set_limit", key="a", limit=2)  # one unit freed: handed to w0, oldest first
    assert (d.state("w0"), d.state("w1")) == (State.RESERVED, State.PARKED)
    d.step("set_limit", key="a", limit=None)  # back to the code's 3: w1's turn
    assert d.state("w1") is State.RESERVED
    d.step("acquire", key="a", lease=20.0)  # refused: s0 and two reservations fill 3
    assert len(d.model.holdings) == 2


def test_schedule_several_keys_are_taken_all_together_or_not_at_all(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(3, 2))
    d.step("acquire", key="b", lease=20.0, weight=2)  # b is full
    d.step("acquire_many", weights=(1, 1), lease=20.0, reverse=False)  # a has room, b not
    d.step("acquire_many", weights=(1, 1), lease=20.0, reverse=True)
    assert [h.key for h in d.model.holdings] == ["b"]  # nothing taken of a
    d.step("acquire_many", weights=(3, 1), lease=20.0, reverse=False)  # refused, b is full
    d.step("release", pick=d.pick("s0"))
    d.step("acquire_many", weights=(2, 2), lease=20.0, reverse=False)  # s1 of a, s2 of b
    d.step("acquire", key="a", lease=20.0, weight=2)  # refused: one unit of a is free
    d.step("acquire", key="a", lease=20.0)  # 3 of 3
    d.step("acquire", key="a", lease=20.0)  # refused
    d.step("force_release", pick=d.pick("s2"), what="slot")  # the group's slot of b
    d.step("extend", pick=d.pick("s2"), lease=20.0)  # gone: the group is lost
    d.step("extend", pick=d.pick("s1"), lease=20.0)  # a's slot of the group is still held
    d.step("acquire_many", weights=(1, 3), lease=20.0, reverse=False)  # weight 3 > limit 2
    assert len(d.model.holdings) == 4


def test_schedule_force_release_all_counts_holders_not_units(
    driven: Callable[..., Driven],
) -> None:
    """Shrunk from the deep profile: a holder of weight 2 is one displaced holder."""
    d = driven(limits=(1, 2))
    d.step("acquire_many", weights=(1, 2), lease=20.0, reverse=False)
    d.step("force_release", pick=d.pick("s1"), what="key")  # s1 is b's slot, weight 2


def test_schedule_a_waiter_of_both_keys_keeps_its_turn_and_is_handed_off_holding_both(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(1, 1))
    d.step("acquire", key="a", lease=20.0)  # s0
    d.step("acquire", key="b", lease=20.0)  # s1
    d.step("park", key="a", runs=1, lease=20.0, max_queued=0)  # w0 waits for a
    d.step("park_many", runs=1, weights=(1, 1), lease=20.0)  # w1 for both, behind w0 on a
    d.step("park", key="b", runs=1, lease=20.0, max_queued=0)  # w2 behind w1 on b
    d.step("release", pick=d.pick("s1"))  # w1 lets b pass: w0 is ahead of it on a
    assert (d.state("w1"), d.state("w2")) == (State.PARKED, State.RESERVED)
    d.step("release", pick=d.pick("s0"))
    d.step("claim", pick=d.pick("w0"), lease=20.0)
    d.step("claim", pick=d.pick("w2"), lease=20.0)
    d.step("release", pick=d.pick("s2"))  # w1 keeps a now, and b's next unit is its own
    assert d.state("w1") is State.PARKED
    d.step("park", key="b", runs=1, lease=20.0, max_queued=0)  # w3 behind w1 on b
    d.step("release", pick=d.pick("s3"))  # gathered: w1 holds both, handed off once
    assert (d.state("w1"), d.state("w3")) == (State.RESERVED, State.PARKED)
    d.step("claim", pick=d.pick("w1"), lease=20.0, delivery="m1")
    assert d.state("w1") is State.DONE
    d.step("release", pick=d.pick("s4"))  # the group's slot of a, then of b: w3's turn
    d.step("release", pick=d.pick("s5"))
    assert d.state("w3") is State.RESERVED


def test_schedule_a_waiter_of_both_keys_cancelled_or_lapsed_strands_nothing(
    driven: Callable[..., Driven],
) -> None:
    d = driven(limits=(1, 1), claims=(0.3, 0.3))
    d.step("acquire", key="a", lease=20.0)  # s0
    d.step("acquire", key="b", lease=20.0)  # s1
    d.step("park_many", runs=2, weights=(1, 1), lease=20.0)  # w0, w1
    d.step("release", pick=d.pick("s0"))  # w0 lets a pass: w1 is no reason to hold it
    d.step("release", pick=d.pick("s1"))  # w0 holds b; a's unit went to w1, which gives it back
    d.step("cancel", pick=d.pick("w0"))  # out of both rooms; b goes on to w1
    assert d.state("w0") is State.DONE
    d.step("sweep", key="a")
    d.step("sweep", key="b")
    d.step("time_passes", wait="past the short leases")
    d.step("sweep", key="a")  # whatever w1 was given lapses back into the rooms in order
    d.step("sweep", key="b")
    d.step("claim", pick=d.pick("w1"), lease=20.0)
    d.step("acquire", key="a", lease=20.0)
    d.step("acquire", key="b", lease=20.0)


# -- bugs the model found -------------------------------------------------------------


def test_a_room_recreated_by_a_requeue_has_a_ttl(redis_server: RedisServer) -> None:
    """The model found it: a waiter put back into an emptied room (here by a sweep, after a
    plain acquire pruned its lapsed reservation) re-created the room with no TTL, so the room
    never expired until the next park. Fixed by room.lua's room_requeue."""
    client = redis_server.client()
    published = Published()
    sem = Semaphore(client, limit=1, lease=20.0, claim_timeout=0.2, on_handoff=published)
    try:
        first = sem.acquire("k")
        assert first is not None
        assert isinstance(sem.room.park("k", "w1", b"run w1"), Parked)
        assert first.release()  # w1's reservation; the room is empty, so Redis deletes it
        assert published.take("k") == [("w1", b"run w1")]
        time.sleep(0.4)  # the reservation lapses unclaimed
        assert sem.acquire("k") is not None  # prunes it without putting w1 back
        assert sem.room.sweep("k") == 0  # puts w1 back: the room exists again
        room = redis_keys("semaphore", "k").room
        assert [w.waiter for w in sem.room.waiters("k")] == ["w1"]
        assert client.pttl(room) > 0, f"{room} has no TTL: it outlives every run that used it"
    finally:
        client.close()
