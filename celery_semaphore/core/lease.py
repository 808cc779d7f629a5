"""What a held slot and its renewal decide, the same for the sync and the asyncio twins,
without their I/O: :class:`LeaseRecord` (a slot's lease clock, and what an extend's or a
release's answer means), :class:`Renewals` (a renewer's schedule: when each slot is due,
which go together in a :class:`Flight`, and when a slot is lost). The sync
:class:`~celery_semaphore.core.slot.Slot` and :mod:`~celery_semaphore.core.heartbeat`, and
the asyncio :class:`~celery_semaphore.asyncio.slot.AsyncSlot` and
:mod:`~celery_semaphore.asyncio.guard`, only send the calls these make, each with its own
concurrency primitive, so the twins cannot judge a slot differently."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from redis.asyncio import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.crc import key_slot

from ..errors import SemaphoreBackendError, SemaphoreLeaseLostError
from . import process
from . import validation as check
from .calls import Call, Renewal, extend_call
from .feedback import retry_after_seconds
from .handoff import HandoffRoute
from .names import Keys
from .replies import Admitted
from .scripts import REDIS_ERRORS, backend_error

logger = logging.getLogger(__name__)

RenewErrorCallback = Callable[[BaseException], object]
"""Called with each renewal round trip that failed without saying the slot is gone."""

C = TypeVar("C")
"""The scripts (client) a slot's round trips go through: sync or asyncio."""


L = TypeVar("L", bound="LossWatch")


class LossWatch:
    """What a slot and a group of slots share about their loss, sync or asyncio:
    :attr:`lost`, set once, and the callbacks that run the moment it is. Each twin says what
    makes ``lost`` (``_new_lost``) and the lock held while a loss and its callbacks are
    judged (``_new_lock``: nothing in an event loop)."""

    lost: threading.Event | asyncio.Event  # a sync slot's is a LazyEvent
    _new_lost: Callable[[], threading.Event | asyncio.Event]
    _new_lock: Callable[[], AbstractContextManager[object]]

    def __init__(self) -> None:
        self.lost = self._new_lost()
        self._callbacks_lock = self._new_lock()
        self._lost_callbacks: list[Callable[[Any], object]] = []
        self._lost_reason = ""

    def when_lost(self: L, callback: Callable[[L], object]) -> None:
        """Call ``callback(slot)`` (for a group, ``callback(group)``, when any of its slots
        is) once, the moment the slot is known to be lost.

        It runs in whichever thread detects the loss (usually the renewer's), or for an
        asyncio slot in the event loop, where it must not block; or at once if the slot is
        already lost. Exceptions it raises are logged.
        """
        with self._callbacks_lock:
            if not self.lost.is_set():
                self._lost_callbacks.append(callback)
                return
        callback(self)

    def _mark_lost(self, reason: str = "") -> None:
        """Judge it lost for ``reason``: set :attr:`lost` and run the callbacks once."""
        with self._callbacks_lock:
            if self.lost.is_set():
                return
            self._lost_reason = reason
            self.lost.set()
            callbacks, self._lost_callbacks = self._lost_callbacks, []
        for callback in callbacks:  # one that raises must not stop the others, nor the renewer
            try:
                callback(self)
            except Exception:
                logger.exception("lost-slot callback %r failed", callback)


class LeaseRecord(LossWatch, Generic[C]):
    """A held slot's identity, lease clock and verdicts; see
    :class:`~celery_semaphore.core.slot.Slot` for the attributes.

    Args:
        scripts (C): the scripts (client) the slot's round trips go through.
        keys (Keys): the semaphore's keys.
        key (str): the semaphore's key.
        limit (int): the limit the slot was taken under.
        token (str): the acquisition's member (see :func:`.process.member_of`);
            :attr:`token` is the token it starts with.
        lease (float): seconds the slot lives without an extend.
        admitted (Admitted): the acquire's answer (expiry and server time, ms).
        sent_at (float): ``time.monotonic()`` when that acquire was sent.
        handoffs (HandoffRoute): where a release's hand-offs go.
        weight (int): how many units of the limit the slot takes.
    """

    # Set once the slot is given back (the sync answer, the asyncio release under way).
    _released: object

    def __init__(
        self,
        scripts: C,
        keys: Keys,
        key: str,
        limit: int,
        token: str,
        lease: float,
        admitted: Admitted,
        sent_at: float,
        handoffs: HandoffRoute,
        weight: int = 1,
    ) -> None:
        super().__init__()
        self.key = key
        self.weight = weight
        # The limit that applied, as the script answered it (a live limit wins over the
        # caller's; see set_limit.lua).
        self.limit = admitted.limit or limit
        # The store knows the holder by its member (process.py): the token and, for a plain
        # acquire, the holder's record after it; views and operators know it by its token.
        self._member = token
        self.token = process.token_of(token)
        self.lease = lease
        self.acquired_at = admitted.now_ms / 1000
        self.expires_at = admitted.expires_at_ms / 1000
        # Local monotonic time at which the last successful acquire/extend was *sent*: the
        # lease began no earlier than that, so the slot is surely ours until `deadline`. (A
        # resent acquire is answered with the slot the first one took, whose lease may end
        # sooner: the deadline is then moved up to match.)
        left = (admitted.expires_at_ms - admitted.now_ms) / 1000
        self._renewed_at = sent_at - max(0.0, lease - left)
        # When the extend that set the current lease was sent: an older reply must not undo it.
        self._lease_sent_at = sent_at
        # Called whenever an extend changes the lease: set by a renewer, so that a changed
        # lease re-plans its next renewal (None: no renewer watches it).
        self._on_lease_change: Callable[[], object] | None = None
        self._scripts = scripts
        self._keys = keys
        self._handoffs = handoffs
        self._released = None
        self.cooling_until = 0.0  # set by a back-off's answer

    def __repr__(self) -> str:
        state = "lost" if self.lost.is_set() else "released" if self.released else "held"
        return (f"<{type(self).__name__} key={self.key!r} limit={self.limit} "
                f"token={self.token[:8]}… {state}>")  # fmt: skip

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` by which a renewal must succeed, or the slot counts as lost:
        one lease after the last successful acquire or extend was *sent*."""
        return self._renewed_at + self.lease

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has run, or (asyncio) is under way; a release that failed
        does not count. From then on a renewal that finds the slot gone is no loss."""
        return self._released is not None

    def lease_lost_error(self) -> SemaphoreLeaseLostError:
        """The error that reports this slot's loss, naming why it was judged lost."""
        reason = self._lost_reason or "the slot was lost"
        return SemaphoreLeaseLostError(
            f"semaphore {self.key!r} (limit {self.limit}): {reason} while its body ran",
            self.key,
            self.limit,
        )

    # -- the renewer's and the twins' side ------------------------------------------------

    def _check_deadline(self) -> None:
        """Mark the slot lost if it is held and its :attr:`deadline` has passed."""
        if not self.released and time.monotonic() >= self.deadline:
            self._mark_lost("no renewal succeeded within one lease")

    def _renewal(self) -> tuple[C, Keys, str, int]:
        """What a batched renewal of this slot sends: the scripts (client) to send it with,
        the semaphore's keys, the member (the store's name for the holder) and the lease
        in ms."""
        return self._scripts, self._keys, self._member, check.lease_ms(self.lease)

    def _renewed(self, sent_at: float, seconds: float, expires_at_ms: int | None) -> bool:
        """Take in the answer to a renewal sent at ``sent_at`` (``time.monotonic()``) for
        ``seconds``: True when the slot is still ours. It does not mark the slot lost on
        False (the caller decides)."""
        if expires_at_ms is None:
            return False
        self._renewed_at = max(self._renewed_at, sent_at)
        if sent_at < self._lease_sent_at:
            return True  # a later extend has already set the lease; this reply is stale
        changed = seconds != self.lease
        self._lease_sent_at = sent_at
        self.lease = seconds
        self.expires_at = expires_at_ms / 1000
        if changed and self._on_lease_change is not None:
            self._on_lease_change()
        return True

    def _extend_call(self, lease: float | None) -> tuple[float, Call[list[int | None]]] | None:
        """What ``extend(lease)`` sends: the lease in seconds and the call; None once the
        slot was released (nothing to send, the answer is False).

        Raises:
            SemaphoreValidationError: ``lease`` is not a positive finite number of seconds.
        """
        seconds = self.lease if lease is None else lease
        ms = check.lease_ms(seconds)
        if self.released:
            return None
        return seconds, extend_call([(self._keys, self._member, ms, self.weight)])

    def _extended(self, sent_at: float, seconds: float, expires_at_ms: int | None) -> bool:
        """What an extend's answer means (see ``extend``): True when the slot is still ours;
        False when it is gone, then lost unless given back meanwhile."""
        if self._renewed(sent_at, seconds, expires_at_ms):
            return True
        if not self.released:
            self._mark_lost("extend found the slot gone")
        return False

    def _verdict(self, back_off: bool = False, retry_after: object = None) -> tuple[str, ...]:
        """What a release tells release.lua of how the run went (see adapt.lua): a run of an
        adaptive key that did not back off ended well, whatever it returned or raised (only
        a back-off says the provider is over its limit); a back-off carries its hint in ms
        (-1: none), clamped to the longest cool-down (and logged), and when the slot was
        taken. Nothing for a run of a fixed limit that did not back off.

        Raises:
            SemaphoreValidationError: ``retry_after`` is negative or unreadable.
        """
        spec, route = self._handoffs.adaptive, self._handoffs
        if not back_off:
            return (spec,) if spec else ()
        hint = retry_after_seconds(retry_after)
        cap_ms = route.max_cool_down_ms
        if hint is not None and hint * 1000 > cap_ms:
            logger.warning("semaphore %r: back-off hint of %gs clamped to %gs",
                           self.key, hint, cap_ms / 1000)  # fmt: skip
            hint = cap_ms / 1000
        hint_ms = -1 if hint is None else round(hint * 1000)
        by = f"{socket.gethostname()}:{process.pid()}"
        return spec, f"{hint_ms} {cap_ms} {round(self.acquired_at * 1000)}", by

    def _given_back(self, owned: bool) -> bool:
        """What a release's answer (``owned``: the store still had the slot) means: ours
        until now only if the store still had it and its lease had not run out by this
        side's own, cautious, reckoning (the store does not read its clock for a key with no
        room: release.lua). A slot that was not is lost."""
        owned = owned and time.monotonic() < self.deadline
        if not owned:
            self._mark_lost("release found the slot already gone")
        return owned


S = TypeVar("S", bound=LeaseRecord[Any])


@dataclass(eq=False)
class RenewalPlan(Generic[S]):
    """One slot registered with a renewer (sync or asyncio), and when to renew it next.

    Attributes:
        slot: the slot.
        share (float): the renewal interval as a share of the lease, kept when the lease
            changes, so a shorter lease is renewed sooner.
        on_error (RenewErrorCallback | None): see :meth:`Semaphore.hold`.
        last_sent (float): ``time.monotonic()`` of the last renewal sent (the acquire, at
            first).
    """

    slot: S
    share: float
    on_error: RenewErrorCallback | None
    last_sent: float

    @property
    def interval(self) -> float:
        """Seconds between renewals, for the slot's current lease."""
        return self.share * self.slot.lease

    @property
    def next_tick(self) -> float:
        """``time.monotonic()`` of the next renewal."""
        return self.last_sent + self.interval


@dataclass(eq=False)
class Batch(Generic[S]):
    """The renewals of one script call: slots of one client and cluster hash slot."""

    plans: list[RenewalPlan[S]]
    call: Call[list[int | None]]

    @property
    def slot(self) -> S:
        """The first slot: its scripts send the call, its key names an error."""
        return self.plans[0].slot


@dataclass(eq=False)
class Flight(Generic[S]):
    """Renewals sent together (one flight per tick), and what came back: per plan, an
    expiry, None (the slot is gone), or the error its batch failed with.

    A renewer sends :meth:`batches` (all at once, or one after another) and hands each
    reply, or the error it raised, to :meth:`answer`; then sets :attr:`done`.
    """

    plans: list[RenewalPlan[S]]
    sent_at: float
    answers: dict[int, int | BaseException | None] = field(default_factory=dict)
    done: bool = False

    @property
    def stale_at(self) -> float:
        """``time.monotonic()`` from which the flight, unanswered, is taken for stuck: one
        renewal interval (the shortest) after it was sent."""
        return self.sent_at + min(plan.interval for plan in self.plans)

    def batches(self) -> list[Batch[S]]:
        """One script call per client and, on a cluster, per hash slot."""
        shards: dict[tuple[int, int], list[tuple[RenewalPlan[S], Renewal]]] = {}
        for plan in self.plans:
            scripts, keys, member, ms = plan.slot._renewal()
            cluster = isinstance(scripts.client, (RedisCluster, AsyncRedisCluster))
            shard = (id(scripts.client), key_slot(keys.slots.encode()) if cluster else 0)
            shards.setdefault(shard, []).append((plan, (keys, member, ms, plan.slot.weight)))
        return [
            Batch([plan for plan, _ in rows], extend_call([renewal for _, renewal in rows]))
            for rows in shards.values()
        ]

    def answer(self, batch: Batch[S], reply: list[int | None] | BaseException) -> None:
        """Record ``batch``'s reply, or the error its round trip raised (a redis-py one
        reported as :class:`SemaphoreBackendError`)."""
        if isinstance(reply, REDIS_ERRORS):
            error = backend_error(reply, batch.slot.key, batch.slot.limit)
            error.__cause__ = reply
            reply = error
        for index, plan in enumerate(batch.plans):
            self.answers[id(plan)] = reply if isinstance(reply, BaseException) else reply[index]


class Renewals(Generic[S]):
    """A renewer's schedule, sync or asyncio: the slots it renews and when, the
    :class:`Flight` out, and the verdicts (the leased-semaphore spec's "two-pronged" rule,
    per slot: a renewal that answers "gone" loses that slot, and only that one; a slot whose
    whole lease passes without a renewal that succeeded is lost at its own deadline, even
    while a round trip hangs).

    The renewer calls :meth:`step` whenever it wakes and sends the flight it answers; the
    sync one holds its lock around every call but :meth:`report`, which runs the error
    callbacks the last step collected.
    """

    def __init__(self) -> None:
        self.plans: dict[int, RenewalPlan[S]] = {}  # id(slot) -> its plan
        self.flight: Flight[S] | None = None
        self._errors: list[tuple[RenewErrorCallback, BaseException]] = []

    def add(
        self, slot: S, interval: float, on_error: RenewErrorCallback | None,
        wake: Callable[[], object],
    ) -> RenewalPlan[S]:  # fmt: skip
        """Renew ``slot`` every ``interval`` seconds (kept in proportion to its lease if the
        lease changes), calling ``wake()`` when a changed lease calls for a renewal now."""
        plan = RenewalPlan(slot, interval / slot.lease, on_error, slot._renewed_at)

        def lease_changed() -> None:
            # Renew at once: a renewal of the old lease still in flight must not be the last
            # word Redis hears.
            plan.last_sent = -math.inf
            wake()

        slot._on_lease_change = lease_changed
        self.plans[id(slot)] = plan
        return plan

    def remove(self, slot: S) -> None:
        """Stop renewing ``slot``: from then on no renewal answer touches it, so a renewal
        racing an intentional release is never taken for a loss."""
        slot._on_lease_change = None
        self.plans.pop(id(slot), None)

    def step(self, now: float) -> tuple[Flight[S] | None, float]:
        """Take in the flight out if it is answered, or stuck (its slots' renewals failed);
        judge lost the slots whose deadline passed; and answer the flight to send now (None:
        none), and when to step next (``time.monotonic()``; ``now`` once no slot is left).
        A renewer whose flight is taken for stuck drops its round trip, which is harmless
        if it reached Redis: extend never re-creates a slot that is gone."""
        flight = self.flight
        if flight is not None and (flight.done or now >= flight.stale_at):
            self.flight = None
            first = flight.plans[0].slot
            stuck = SemaphoreBackendError(
                f"Redis did not answer a renewal for semaphore {first.key!r} within "
                f"{flight.stale_at - flight.sent_at:g}s",
                first.key,
                first.limit,
            )
            for plan in flight.plans:
                self._take(plan, flight.sent_at, flight.answers.get(id(plan), stuck))
        for plan in list(self.plans.values()):
            if now >= plan.slot.deadline:
                self._lose(plan, "no renewal succeeded within one lease")
        plans = list(self.plans.values())
        if not plans:
            return None, now
        # When the first slot's tick comes, every slot due within half its own interval goes
        # along: the slots fall into step, and each tick is one round trip.
        sent = None
        if self.flight is None and min(plan.next_tick for plan in plans) <= now:
            due = [plan for plan in plans if plan.next_tick - plan.interval / 2 <= now]
            for plan in due:
                plan.last_sent = now
            sent = self.flight = Flight(due, now)
        # While a flight is out, its answer wakes the renewer; until then only the deadlines
        # and the moment it is taken for stuck.
        wake = [plan.slot.deadline for plan in plans]
        if self.flight is not None:
            wake.append(self.flight.stale_at)
        else:
            wake.extend(plan.next_tick for plan in plans)
        return sent, min(wake)

    def _take(
        self, plan: RenewalPlan[S], sent_at: float, answer: int | BaseException | None
    ) -> None:
        slot = plan.slot
        if self.plans.get(id(slot)) is not plan:
            return  # removed (released) while the flight was out
        if isinstance(answer, BaseException):
            if plan.on_error is not None:
                self._errors.append((plan.on_error, answer))
        elif not slot._renewed(sent_at, slot.lease, answer):
            self._lose(plan, "a renewal found the slot gone")

    def _lose(self, plan: RenewalPlan[S], reason: str) -> None:
        if not plan.slot.released:  # not given back by the body itself meanwhile
            plan.slot._mark_lost(reason)
        self.plans.pop(id(plan.slot), None)

    def report(self) -> None:
        """Call each ``on_error`` with the failed round trip the last :meth:`step` took in;
        one that raises is swallowed (a broken telemetry hook must not stop renewal)."""
        errors, self._errors = self._errors, []
        for on_error, error in errors:
            with contextlib.suppress(Exception):
                on_error(error)
