"""A plain-Python model of the semaphore and its waiting room, for ``tests/test_model.py``.

The model never reads Redis. It knows what each call was answered, and when the call was sent
and its answer received (``time.monotonic()`` seconds), and from that alone says what Redis
may hold. Time makes much of it uncertain: a slot granted by a call sent at ``sent`` and
answered at ``received`` with a lease of ``L`` seconds is *surely held* only while
``now < sent + L - MARGIN``, and *surely gone* only once ``now > received + L + MARGIN``; in
between it is *maybe held*, and every check allows either. A call that got no answer (a paused
server) leaves more things "maybe": the model keeps, for each, the latest moment it could
still be live, counted from when the server was surely answering again (``settle``).

Each public method takes a call's timing and answer, raises :class:`ModelViolation` (an
``AssertionError`` that says what failed) if the answer is impossible, and updates the model.

Each key has the limit its callers give (``code_limit``) and the limit in effect now
(``limit``: a live limit while one is set). Every grant records the limit it was made under,
so after a live limit is lowered the holders from before may stand above the new one, but
never above the limit of their own grant. A holding counts its ``weight`` units wherever
slots are counted; an acquire of several keys makes one holding per key, all of one token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NoReturn

MARGIN = 0.35
"""Seconds of slack on each side of a lease or claim boundary (clock granularity, a noisy
machine). Every check allows both answers within it."""


class ModelViolation(AssertionError):
    """The library answered something the model says cannot happen."""


def violated(message: str) -> NoReturn:
    raise ModelViolation(message)


@dataclass(frozen=True)
class Call:
    """One round trip: when it was sent and when its answer (or error) came back."""

    sent: float
    received: float


@dataclass
class Window:
    """When something that may be live in Redis (a slot, a reservation) is surely live and
    when it is surely gone, in ``time.monotonic()`` seconds."""

    held_until: float
    gone_after: float
    limit: int
    """The key's limit when it was granted (what it may stand above a lowered limit by)."""

    @classmethod
    def granted(cls, call: Call, seconds: float, limit: int) -> Window:
        """Made by ``call`` for ``seconds``: the server ran it between send and answer."""
        return cls(call.sent + seconds - MARGIN, call.received + seconds + MARGIN, limit)

    @classmethod
    def maybe(cls, gone_after: float, limit: int) -> Window:
        """Perhaps made by a call that got no answer: never surely held."""
        return cls(-math.inf, gone_after, limit)

    def held(self, at: float) -> bool:
        return at < self.held_until

    def gone(self, at: float) -> bool:
        return at > self.gone_after

    def end(self, at: float) -> None:
        """A call answered at ``at`` removed it (or said it was gone)."""
        self.held_until = -math.inf
        self.gone_after = min(self.gone_after, at)

    def blur(self) -> None:
        """A call that got no answer may have removed it."""
        self.held_until = -math.inf

    def describe(self, at: float) -> str:
        if self.held(at):
            return f"surely held for {self.held_until - at:.3f}s more"
        if self.gone(at):
            return f"surely gone for {at - self.gone_after:.3f}s"
        return f"maybe held (surely gone in {self.gone_after - at:.3f}s)"


@dataclass
class Holding:
    """A slot the test got: from acquire, or from park or claim."""

    name: str
    key: str
    token: str
    lease: float
    window: Window
    released: bool | None = None
    """The answer of the first release that got one (later calls repeat it)."""
    weight: int = 1
    group: str = ""
    """The group it was acquired with (``acquire_many``), or "" for a slot of its own."""

    def __str__(self) -> str:
        extra = f", weight {self.weight}" if self.weight > 1 else ""
        extra += f", of {self.group}" if self.group else ""
        return f"{self.name} (key {self.key!r}, token {self.token[:8]}{extra})"


class State(Enum):
    PARKED = "parked"
    """Surely in the room: its park or claim answered "parked", and nothing handed it off."""
    RESERVED = "reserved"
    """Handed off: a reservation holds a slot for it (see its window). Once that lapsed it is
    back in the room, or, if a plain acquire pruned the reservation, only in the parked hash
    until a sweep puts it back."""
    UNSURE = "unsure"
    """A call about it got no answer: it may be parked, reserved, holding or gone."""
    DONE = "done"
    """Out of the room for good: see ``done_why``."""


@dataclass
class Waiter:
    """A waiter the test parked."""

    name: str
    key: str
    arrival: float
    payloads: set[bytes]
    """The payloads its hand-off may carry (more than one after an unanswered re-park)."""
    state: State = State.PARKED
    reservation: Window | None = None
    reserved_at: Call | None = None
    """The call that handed it its reservation (None: a call with no answer may have)."""
    done_why: str = ""
    needs: dict[str, int] = field(default_factory=dict)
    """A waiter of several keys (``park_many``): each key it needs and its weight there
    (``key`` is the first); empty for a waiter of one key."""
    holds: dict[str, Window] = field(default_factory=dict)
    """A waiter of several keys: what it may hold of each key (see :class:`Model`)."""
    since: float = math.inf
    """A waiter of one key: when the answer came that put it surely in its room (it has been
    there since, while PARKED); of several keys: when its first park was sent (any unit it
    holds it was given since)."""

    @property
    def many(self) -> bool:
        return bool(self.needs)

    def surely_reserved(self, at: float) -> bool:
        if self.many:
            return self.state is State.RESERVED and all(w.held(at) for w in self.holds.values())
        return self.reservation is not None and self.reservation.held(at)

    def maybe_in_room(self, at: float) -> bool:
        return self.state is not State.DONE and not self.surely_reserved(at)

    def finish(self, why: str, at: float) -> None:
        self.state, self.done_why = State.DONE, why
        if self.reservation is not None:
            self.reservation.end(at)
        for window in self.holds.values():
            window.end(at)

    def unknown_holds(self, limits: dict[str, int]) -> None:
        """A waiter of several keys that waits: any call on its keys may reserve its units,
        keep them, give them back or hand it off without telling the test, so what it holds
        is never sure, nor surely gone, until it is done; granted, maybe, under the highest
        limit its key had meanwhile (a live limit lowered since evicts nobody)."""
        self.holds = {
            k: Window.maybe(math.inf, max(limits[k], self.holds[k].limit if k in self.holds else 0))
            for k in self.needs
        }

    def __str__(self) -> str:
        state = self.done_why if self.state is State.DONE else self.state.value
        keys = "+".join(self.needs) if self.many else self.key
        return f"waiter {self.name} (key {keys!r}, {state})"


@dataclass(frozen=True)
class Outcome:
    """What park or claim answered, without the library's types: ``kind`` is "slot" (with
    the slot's token), "parked" (with its position), "full" or "not waiting" (with
    ``again``: the claiming delivery is the one that claimed before)."""

    kind: str
    token: str = ""
    position: int = 0
    again: bool = False


@dataclass
class KeyModel:
    """One semaphore key: its limit, the slots the test holds, the waiters it parked, and
    phantoms, slots that calls with no answer may have taken for tokens nobody knows."""

    name: str
    code_limit: int
    claim_timeout: float
    grace: float = 0.0
    """Seconds a reservation is its waiter's alone; after that a waiter that parks in person
    may take it (0: never)."""
    holdings: list[Holding] = field(default_factory=list)
    phantoms: list[tuple[int, Window]] = field(default_factory=list)
    """(weight, window) of slots that calls with no answer may have taken."""
    waiters: list[Waiter] = field(default_factory=list)
    many: list[Waiter] = field(default_factory=list)
    """The waiters of several keys that need this one (not in ``waiters``)."""
    limit: int = 0
    """The limit in effect: the live limit while one is set, else ``code_limit``."""

    def __post_init__(self) -> None:
        self.limit = self.limit or self.code_limit

    def windows(self) -> Iterator[tuple[int, Window]]:
        """(weight, window) of everything that may count against the limit."""
        for h in self.holdings:
            yield h.weight, h.window
        for w in self.waiters:
            if w.reservation is not None:
                yield 1, w.reservation
        for w in self.many:
            yield w.needs[self.name], w.holds[self.name]
        yield from self.phantoms

    def describe(self, at: float) -> str:
        """Everything that may count against the limit, for a violation's message."""
        parts = [f"{h} {h.window.describe(at)} (granted at limit {h.window.limit})"
                 for h in self.holdings if not h.window.gone(at)]  # fmt: skip
        parts += [f"reservation of {w.name} {w.reservation.describe(at)}" for w in self.waiters
                  if w.reservation is not None and not w.reservation.gone(at)]  # fmt: skip
        parts += [f"phantom of weight {n} {p.describe(at)}" for n, p in self.phantoms
                  if not p.gone(at)]  # fmt: skip
        return f"key {self.name!r} limit {self.limit} (code {self.code_limit}): " + "; ".join(
            parts or ["nothing live"]
        )

    def ceiling(self, at: float, surely: bool) -> int:
        """The most units that may be live at ``at``: the limit now, or a higher one that a
        grant still (surely, or maybe) live was made under before the limit was lowered."""
        grants = [
            win.limit for _, win in self.windows() if (win.held(at) if surely else not win.gone(at))
        ]
        return max([self.limit, *grants])

    def surely_live(self, at: float, excluding: Window | None = None) -> int:
        return sum(n for n, win in self.windows() if win is not excluding and win.held(at))

    def maybe_live(self, at: float, excluding: Window | None = None) -> int:
        return sum(n for n, win in self.windows() if win is not excluding and not win.gone(at))

    def parked(self) -> list[Waiter]:
        return [w for w in self.waiters if w.state is State.PARKED]

    def stale(self, call: Call, parker: Waiter) -> tuple[list[Waiter], list[Waiter]]:
        """The waiters whose reservation ``parker``, parking in ``call``, may take because it
        is older than the grace, and those whose reservation it surely could."""
        maybe: list[Waiter] = []
        surely: list[Waiter] = []
        if self.grace <= 0:
            return maybe, surely
        for w in self.waiters:
            if w is parker or w.reservation is None or w.reservation.gone(call.sent):
                continue
            made = w.reserved_at
            if made is None or made.sent <= call.received - self.grace + MARGIN:
                maybe.append(w)
                if (
                    made is not None
                    and w.reservation.held(call.received)
                    and made.received <= call.sent - self.grace - MARGIN
                ):
                    surely.append(w)
        return maybe, surely


class Model:
    """The whole model: every key, the slots the test holds and the waiters it parked.

    Args:
        limits: each key's limit.
        claim_timeouts: each key's claim timeout (seconds a hand-off's reservation lives).
        graces: each key's hand-off grace (seconds; 0 or missing: never taken).
    """

    def __init__(
        self,
        limits: dict[str, int],
        claim_timeouts: dict[str, float],
        graces: dict[str, float] | None = None,
    ) -> None:
        graces = graces or {}
        self.keys = {
            k: KeyModel(k, limits[k], claim_timeouts[k], graces.get(k, 0.0)) for k in limits
        }
        self.holdings: list[Holding] = []
        self.waiters: dict[str, Waiter] = {}
        self.deliveries: dict[str, set[str | None]] = {}
        """What the claims hash may hold for each waiter: the delivery whose claim took its
        hand-off (None: none recorded)."""
        self._unsettled: list[Callable[[float], None]] = []

    # -- slots --------------------------------------------------------------------------

    def _hold(
        self, key: str, call: Call, token: str, lease: float, weight: int = 1, group: str = ""
    ) -> Holding:
        km = self.keys[key]
        window = Window.granted(call, lease, km.limit)
        h = Holding(f"s{len(self.holdings)}", key, token, lease, window, weight=weight, group=group)
        self.holdings.append(h)
        km.holdings.append(h)
        return h

    def acquire(
        self,
        key: str,
        call: Call,
        lease: float,
        token: str | None,
        handoffs: Sequence[tuple[str, bytes]],
        weight: int = 1,
    ) -> Holding | None:
        """``Semaphore.acquire(key, lease=lease, weight=weight)`` answered a slot with
        ``token``, or None."""
        held = self.acquire_many(
            [(key, weight)], call, lease, token, {key: list(handoffs)}, behind_room=True
        )
        return held[0] if held else None

    def acquire_many(
        self,
        specs: Sequence[tuple[str, int]],
        call: Call,
        lease: float,
        token: str | None,
        handoffs: dict[str, list[tuple[str, bytes]]],
        behind_room: bool = False,
    ) -> list[Holding] | None:
        """``Semaphore.acquire_many`` of ``(key, weight)`` pairs (or ``acquire``, with one)
        answered slots under ``token``, or None: all of them or none. With ``behind_room``
        (``acquire``), a key whose room may hold a waiter may refuse it: its free units are
        the room's."""
        slow = call.received - call.sent >= lease
        # A reply after a whole lease is not trusted: its slots are released at once, which
        # may hand them to waiters.
        if not slow and any(handoffs.values()):
            violated(f"acquire of {specs} published hand-offs {handoffs} (it never hands off)")
        for key, _ in specs:
            km = self.keys[key]
            self._serve(
                km, call, handoffs.get(key, []), in_room=km.parked(),
                at_most=km.limit - km.surely_live(call.received),
            )  # fmt: skip
        if token is None:
            if not slow and all(
                self.keys[k].maybe_live(call.sent) + w <= self.keys[k].limit
                and not (behind_room and any(
                    v.maybe_in_room(call.sent) for v in self.waiters.values()
                    if k == v.key or k in v.needs
                ))
                for k, w in specs
            ):  # fmt: skip
                state = {
                    k: (self.keys[k].maybe_live(call.sent), self.keys[k].limit) for k, _ in specs
                }
                violated(
                    f"acquire of {specs} was refused with room for every weight: (at most "
                    f"held, limit) {state}"
                )
            if slow:  # the give-back may have failed, or handed off with nobody told
                for key, weight in specs:
                    km = self.keys[key]
                    km.phantoms.append(
                        (weight, Window.maybe(call.received + lease + MARGIN, km.limit))
                    )
                    self._blur_room(km, call.received)
            return None
        for key, weight in specs:
            km = self.keys[key]
            surely = km.surely_live(call.received)
            if surely + weight > km.limit:
                violated(
                    f"acquire of {specs} got a slot of {key!r} (weight {weight}) while {surely} "
                    f"unit(s) were surely held, limit {km.limit}"
                )
        group = f"g{len(self.holdings)}" if len(specs) > 1 else ""
        return [self._hold(key, call, token, lease, weight, group) for key, weight in specs]

    def set_limit(
        self, key: str, call: Call, limit: int | None, handoffs: Sequence[tuple[str, bytes]]
    ) -> None:
        """``Semaphore.set_limit(key, limit)`` (None: clear) published ``handoffs``: a raise
        hands what it frees to the oldest waiters, a cut evicts nobody."""
        km = self.keys[key]
        km.limit = km.code_limit if limit is None else limit
        parked = km.parked()
        self._serve(
            km, call, handoffs, in_room=parked,
            at_least=min(len(parked), km.limit - km.maybe_live(call.sent)),
            at_most=km.limit - km.surely_live(call.received),
        )  # fmt: skip

    def extend(self, h: Holding, call: Call, lease: float, answer: bool) -> None:
        """``slot.extend(lease)`` answered ``answer``."""
        if h.released is not None:
            if answer:
                violated(f"extend of released {h} answered True")
            return
        if answer and h.window.gone(call.sent):
            violated(f"extend of {h} revived it: it was {h.window.describe(call.sent)}")
        if not answer and h.window.held(call.received):
            violated(f"extend of {h} said gone while {h.window.describe(call.received)}")
        if answer:
            h.window, h.lease = Window.granted(call, lease, h.window.limit), lease
        else:
            h.window.end(call.received)

    def _check_owned(self, h: Holding, call: Call, answer: bool, what: str) -> None:
        if not answer and h.window.held(call.received):
            violated(f"{what} of {h} said not owned while {h.window.describe(call.received)}")
        if answer and h.window.gone(call.sent):
            violated(f"{what} of {h} said owned while {h.window.describe(call.sent)}")

    def release(
        self, h: Holding, call: Call, answer: bool, handoffs: Sequence[tuple[str, bytes]]
    ) -> None:
        """``slot.release()`` answered ``answer`` and published ``handoffs``."""
        km = self.keys[h.key]
        if h.released is not None:
            if answer != h.released or handoffs:
                violated(f"a second release of {h} answered {answer}, the first {h.released}")
            return
        self._check_owned(h, call, answer, "release")
        capacity = km.limit - km.maybe_live(call.sent, excluding=h.window)
        parked = km.parked()
        self._serve(
            km, call, handoffs, in_room=parked,
            at_least=min(len(parked), capacity),
            at_most=km.limit - km.surely_live(call.received, excluding=h.window),
        )  # fmt: skip
        h.released = answer
        h.window.end(call.received)

    def force_release(self, h: Holding, call: Call, answer: bool) -> None:
        """An operator's ``SemaphoreAdmin.force_release(key, token)`` answered ``answer``
        (an admin with no publisher hands nothing off)."""
        self._check_owned(h, call, answer, "force_release")
        h.window.end(call.received)

    def force_release_reservation(
        self, name: str, call: Call, answer: bool, key: str | None = None
    ) -> None:
        """An operator's ``force_release(key, "~" + name)`` answered ``answer``: the waiter
        keeps its place in the parked hash, out of the room until a sweep puts it back (a
        waiter of several keys: its reservation of ``key``, which may come back)."""
        w = self.waiters[name]
        self._lapse_many(call.sent)
        window = w.holds.get(key or w.key) if w.many else w.reservation
        if w.state is not State.UNSURE:
            if answer and (window is None or window.gone(call.sent)):
                violated(f"force_release of the reservation of {w} said it was live")
            if not answer and window is not None and window.held(call.received):
                violated(
                    f"force_release of the reservation of {w} said not live while it was "
                    f"{window.describe(call.received)}"
                )
        if window is not None:
            window.end(call.received)
        if w.many and w.state is not State.DONE:
            w.unknown_holds(self.limits)

    def force_release_all(self, key: str, call: Call, displaced: int) -> None:
        """An operator's ``force_release_all(key)`` answered ``displaced``."""
        km = self.keys[key]
        # It counts holders, not units: a holder of weight w is one.
        surely = sum(win.held(call.received) for _, win in km.windows())
        maybe = sum(not win.gone(call.sent) for _, win in km.windows())
        if not surely <= displaced <= maybe:
            violated(
                f"force_release_all of {key!r} displaced {displaced} holder(s), the model says "
                f"{surely} to {maybe}"
            )
        for _, win in km.windows():
            win.end(call.received)

    # -- the waiting room ---------------------------------------------------------------

    def _serve(
        self,
        km: KeyModel,
        call: Call,
        handoffs: Sequence[tuple[str, bytes]],
        in_room: list[Waiter],
        also: Waiter | None = None,
        at_least: int = 0,
        at_most: int | None = None,
        stole: bool = False,
    ) -> None:
        """Check and record the waiters ``call`` served: ``handoffs`` it published, and
        ``also``, a waiter it gave a slot at once. ``in_room`` were surely in the room when it
        was sent; it must serve at least ``at_least`` and at most ``at_most`` waiters of
        ``km``. With ``stole``, ``also`` may instead have taken a reservation past its grace:
        out of turn, and in a slot that was not free.

        A call on one key may also hand off waiters of several keys (gathered: see
        :meth:`_serve_many`), and waiters of another key, served when one of several keys
        gave units back there; each is checked against its own room."""
        self._lapse_many(call.sent)
        mine, others, many = [], {}, []
        for name, payload in handoffs:
            w = self.waiters.get(name)
            if w is not None and w.many:
                many.append((name, payload))
            elif w is not None and w.key != km.name:
                others.setdefault(w.key, []).append((name, payload))
            else:
                mine.append((name, payload))
        self._serve_key(km, call, mine, in_room, also, at_least, at_most, stole)
        for key, theirs in others.items():
            okm = self.keys[key]
            self._serve_key(okm, call, theirs, okm.parked(),
                            at_most=okm.limit - okm.surely_live(call.received),
                            claim=km.claim_timeout)  # fmt: skip
        served = {name for name, _ in handoffs} | ({also.name} if also else set())
        self._serve_many(km, call, many, served)

    def _serve_key(
        self,
        km: KeyModel,
        call: Call,
        handoffs: Sequence[tuple[str, bytes]],
        in_room: list[Waiter],
        also: Waiter | None = None,
        at_least: int = 0,
        at_most: int | None = None,
        stole: bool = False,
        claim: float | None = None,
    ) -> None:
        """:meth:`_serve` for the waiters of ``km`` (``claim``: the claim timeout of the
        semaphore that made the call, when it was another key's)."""
        served = [name for name, _ in handoffs] + ([also.name] if also else [])
        in_turn = served[:-1] if also and stole else served
        if len(served) < at_least:
            waiting = [w.name for w in in_room]
            violated(
                f"a call on {km.name!r} served {served} but free slots were enough for "
                f"{at_least} of the parked waiters {waiting}"
            )
        if at_most is not None and len(in_turn) > max(0, at_most):
            violated(
                f"a call on {km.name!r} served {in_turn}, more than the {max(0, at_most)} "
                f"slot(s) that could be free (limit {km.limit})"
            )
        if len(set(served)) != len(served):
            violated(f"a call on {km.name!r} served a waiter twice: {served}")
        arrivals: list[float] = []
        for name, payload in handoffs:
            w = self.waiters.get(name)
            if w is None or w.key != km.name:
                violated(f"hand-off of {name!r} on {km.name!r}, a waiter never parked there")
            if w.state is State.DONE:
                violated(f"{w} was handed off")
            if w.surely_reserved(call.received):
                violated(f"{w} was handed off again while its reservation was surely live")
            if payload not in w.payloads:
                violated(f"{w} was handed off with {payload!r}, not one of {w.payloads}")
            arrivals.append(w.arrival)
        if arrivals != sorted(arrivals):
            violated(f"a call on {km.name!r} handed off out of arrival order: {served}")
        if in_turn:
            newest = max([*arrivals, *([also.arrival] if also and not stole else [])])
            for w in in_room:
                if w.arrival < newest and w.name not in served:
                    violated(f"{in_turn} were served on {km.name!r} before older {w}")
        for name, payload in handoffs:
            w = self.waiters[name]
            w.state, w.payloads = State.RESERVED, {payload}
            w.reservation = Window.granted(call, claim or km.claim_timeout, km.limit)
            w.reserved_at = call

    def _past_grace(
        self, km: KeyModel, w: Waiter, call: Call, outcome: Outcome, what: str
    ) -> list[Waiter]:
        """The waiters whose reservation ``w``'s park or claim in ``call`` may have taken
        past the grace (it answered ``outcome``): it never waits while one is surely
        there to take."""
        maybe, surely = km.stale(call, w)
        if outcome.kind == "parked" and surely:
            violated(
                f"{what} of {w} waited while the reservation of {surely[0]} was unclaimed "
                f"past the grace of {km.grace}s"
            )
        return maybe if outcome.kind == "slot" else []

    def _position_bounds(
        self, km: KeyModel, w: Waiter, call: Call, served: set[str]
    ) -> tuple[int, int]:
        older = [v for v in km.waiters if v is not w and v.arrival < w.arrival]
        older = [v for v in older if v.name not in served]
        low = sum(v.state is State.PARKED for v in older)
        many = [v for v in km.many if v.arrival < w.arrival]  # maybe in the order, maybe not
        return low, sum(v.maybe_in_room(call.received) for v in [*older, *many])

    def park(
        self,
        key: str,
        name: str,
        payload: bytes,
        arrival: float,
        lease: float,
        max_queued: int,
        call: Call,
        outcome: Outcome,
        handoffs: Sequence[tuple[str, bytes]],
    ) -> Holding | None:
        """``Semaphore.park(key, name, payload, arrival=...)`` answered ``outcome``.

        A waiter the model knows (parked, reserved) keeps its first arrival; a new one, or
        one out of the room for good, is parked anew."""
        km = self.keys[key]
        w = self.waiters.get(name)
        if w is not None and w.state is State.UNSURE:
            raise ValueError("the test does not re-park a waiter the model is unsure of")
        if w is not None and w.state is not State.DONE:
            return self._rejoin(w, call, lease, outcome, handoffs, payload)
        w = Waiter(name, key, arrival, {payload})
        self.waiters[name] = w
        km.waiters = [v for v in km.waiters if v.name != name] + [w]
        parked = [v for v in km.parked() if v is not w]
        capacity = km.limit - km.maybe_live(call.sent)
        surely = km.surely_live(call.received)
        queued_low = len(parked)
        queued_high = sum(
            v.maybe_in_room(call.received) for v in [*km.waiters, *km.many] if v is not w
        )
        if outcome.kind == "full":
            if max_queued == 0 or queued_high < max_queued:
                violated(
                    f"park of {w} answered room full (max_queued {max_queued}) with at most "
                    f"{queued_high} waiter(s) maybe in the room"
                )
            if handoffs:
                violated(f"park of {w} was refused yet handed off {handoffs}")
            w.finish("refused: room full", call.received)
            return None
        if max_queued and queued_low >= max_queued:
            violated(
                f"park of {w} was let in past max_queued {max_queued} with {queued_low} "
                "waiter(s) surely in the room"
            )
        served = {n for n, _ in handoffs}
        if outcome.kind == "parked":
            low, high = self._position_bounds(km, w, call, served)
            if not low <= outcome.position <= high:
                violated(f"park of {w} answered position {outcome.position}, not {low}..{high}")
        elif outcome.kind != "slot":
            violated(f"park of {w} answered {outcome.kind!r}")
        took = outcome.kind == "slot"
        passed = self._past_grace(km, w, call, outcome, "park")
        self._serve(
            km, call, handoffs, in_room=[*parked, w], also=w if took else None,
            at_least=min(len(parked) + 1, capacity), at_most=km.limit - surely,
            stole=bool(passed),
        )  # fmt: skip
        for v in passed:  # maybe passed over: back at the head of the room
            assert v.reservation is not None
            v.reservation.blur()
        if took:
            w.finish("took a slot", call.received)
            return self._hold(key, call, outcome.token, lease)
        w.since = call.received
        return None

    def _rejoin(
        self,
        w: Waiter,
        call: Call,
        lease: float,
        outcome: Outcome,
        handoffs: Sequence[tuple[str, bytes]],
        payload: bytes | None,
        delivery: str = "",
    ) -> Holding | None:
        """park (``payload``) or claim (None, with ``delivery``) of a waiter that is parked
        or reserved: it takes its reservation, or joins the room again at its first
        arrival."""
        km = self.keys[w.key]
        what = "claim" if payload is None else "re-park"
        reserved = w.reservation is not None and not w.reservation.gone(call.sent)
        if w.surely_reserved(call.received) and outcome.kind != "slot":
            violated(f"{what} of {w} answered {outcome.kind!r} while its reservation was live")
        if outcome.kind not in ("slot", "parked"):
            violated(f"{what} of {w} answered {outcome.kind!r}")
        parked = [v for v in km.parked() if v is not w]
        in_room = parked if reserved else [*parked, w]
        window = w.reservation
        served = {n for n, _ in handoffs}
        if outcome.kind == "parked":
            low, high = self._position_bounds(km, w, call, served)
            if not low <= outcome.position <= high:
                violated(f"{what} of {w} answered position {outcome.position}, not {low}..{high}")
        if w.surely_reserved(call.received):
            if handoffs:
                violated(f"{what} of {w} took its reservation and handed off {handoffs}")
        else:
            passed = self._past_grace(km, w, call, outcome, what)
            self._serve(
                km, call, handoffs, in_room=in_room,
                also=w if outcome.kind == "slot" and not reserved else None,
                at_least=0 if reserved else min(len(in_room), km.limit - km.maybe_live(
                    call.sent, excluding=window)),
                at_most=km.limit - km.surely_live(call.received, excluding=window),
                stole=bool(passed),
            )  # fmt: skip
            for v in passed:  # maybe passed over: back at the head of the room
                assert v.reservation is not None
                v.reservation.blur()
        if payload is not None:
            w.payloads = {payload}
        if outcome.kind == "slot":
            if delivery:  # recorded when the claim took its own hand-off, not another's
                known = self.deliveries.setdefault(w.name, {None})
                if w.surely_reserved(call.received):
                    known.clear()
                known.add(delivery)
            w.finish("claimed its slot", call.received)
            return self._hold(w.key, call, outcome.token, lease)
        if w.state is not State.PARKED:
            w.since = call.received
        w.state = State.PARKED
        if w.reservation is not None:
            w.reservation.end(call.received)
        return None

    def claim(
        self,
        name: str,
        call: Call,
        lease: float,
        outcome: Outcome,
        handoffs: Sequence[tuple[str, bytes]],
        delivery: str = "",
    ) -> Holding | None:
        """``Semaphore.claim(key, name, delivery=delivery)`` answered ``outcome``."""
        w = self.waiters[name]
        km = self.keys[w.key]
        if outcome.kind == "not waiting":
            known = self.deliveries.get(name, {None})
            if outcome.again and (not delivery or delivery not in known):
                violated(f"claim of {w} by {delivery!r} said again; recorded: {known}")
            if not outcome.again and delivery and known == {delivery}:
                violated(f"claim of {w} by {delivery!r}, which claimed it before, said a copy")
        if w.state is State.DONE:
            if outcome.kind != "not waiting" or handoffs:
                violated(f"claim of {w} answered {outcome.kind!r} with hand-offs {handoffs}")
            return None
        if w.state is State.UNSURE:
            if outcome.kind == "not waiting":
                w.finish("not waiting (after a call with no answer)", call.received)
                self._serve(km, call, handoffs, in_room=km.parked())
                return None
            w.state = State.RESERVED if w.reservation is not None else State.PARKED
            w.since = call.received
            if w.reservation is not None:
                w.reservation.blur()
        return self._rejoin(w, call, lease, outcome, handoffs, None, delivery)

    def cancel(
        self,
        name: str,
        call: Call,
        found: bool,
        handoffs: Sequence[tuple[str, bytes]],
        key: str | None = None,
    ) -> None:
        """``WaitingRoom.cancel(key, name)`` answered ``found``: a waiter of several keys
        leaves every room, whichever ``key`` it was cancelled with."""
        w = self.waiters[name]
        km = self.keys[key or w.key]
        self._lapse_many(call.sent)
        if w.state in (State.PARKED, State.RESERVED) and not found:
            violated(f"cancel of {w} answered not found")
        if w.state is State.DONE and found:
            violated(f"cancel of {w} answered found")
        window = w.holds.get(km.name) if w.many else w.reservation
        if w.many and w.state is not State.DONE:  # out before the units it freed are served
            w.finish("cancelled", call.received)
        parked = [v for v in km.parked() if v is not w]
        capacity = km.limit - km.maybe_live(call.sent, excluding=window)
        if w.state is State.UNSURE:
            capacity = 0  # it may have held a slot nobody knows
        self._serve(
            km, call, handoffs, in_room=parked, at_least=min(len(parked), capacity),
            at_most=km.limit - km.surely_live(call.received, excluding=window),
        )  # fmt: skip
        if w.state is not State.DONE:
            w.finish("cancelled", call.received)

    def sweep(
        self, key: str, call: Call, handed: int, handoffs: Sequence[tuple[str, bytes]]
    ) -> None:
        """``SemaphoreAdmin.sweep(key)`` answered ``handed`` and published ``handoffs``.

        A sweep puts back into the room every waiter whose reservation lapsed (even one a
        plain acquire pruned), then hands free slots to the oldest: after it, every such
        waiter it did not serve is surely in the room."""
        km = self.keys[key]
        if handed != len(handoffs):
            violated(f"sweep of {key!r} answered {handed} but published {len(handoffs)}")
        lapsed = [
            w
            for w in km.waiters
            if w.state is State.RESERVED
            and w.reservation is not None
            and w.reservation.gone(call.sent)
        ]
        in_room = sorted(km.parked() + lapsed, key=lambda w: w.arrival)
        self._serve(
            km, call, handoffs, in_room=in_room,
            at_least=min(len(in_room), km.limit - km.maybe_live(call.sent)),
            at_most=km.limit - km.surely_live(call.received),
        )  # fmt: skip
        served = {n for n, _ in handoffs}
        for w in lapsed:
            if w.name not in served:
                w.state, w.reservation, w.since = State.PARKED, None, call.received

    # -- waiters of several keys ---------------------------------------------------------
    #
    # A waiter of several keys (park_many) waits in the room of each key it needs, and the
    # calls on those keys reserve its units, keep them, give them back and gather it without
    # telling the test: while it waits, every unit it needs of each key may be held for it
    # (a "maybe" window that never surely ends), and when it is handed off (published, by
    # whatever call gathered it) it surely holds a reservation of every key for a claim
    # lease. It is handed off, or takes its slots, only when it was first in every room it
    # needs: never while a waiter older than itself has surely waited in one of them since
    # before it parked.

    @property
    def limits(self) -> dict[str, int]:
        return {k: km.limit for k, km in self.keys.items()}

    def _lapse_many(self, at: float) -> None:
        """What a waiter of several keys holds is unknown while it waits, and once the
        reservations it was handed off with may have lapsed (see :meth:`Waiter.unknown_holds`)."""
        for w in self.waiters.values():
            if not w.many or w.state is State.DONE:
                continue
            if w.state is not State.RESERVED or any(x.gone(at) for x in w.holds.values()):
                w.unknown_holds(self.limits)

    def _check_first(self, w: Waiter, call: Call, served: set[str], what: str) -> None:
        for key in w.needs:
            for v in self.keys[key].waiters:
                if (v.state is State.PARKED and v.arrival < w.arrival and v.since < w.since
                        and v.name not in served):  # fmt: skip
                    violated(f"{w} {what} while older {v} was in the room of {key!r} all along")

    def _serve_many(
        self, km: KeyModel, call: Call, handoffs: Sequence[tuple[str, bytes]], served: set[str]
    ) -> None:
        """Check and record the waiters of several keys that ``call`` (on ``km``) handed off:
        each now surely holds a reservation of every key it needs."""
        for name, payload in handoffs:
            w = self.waiters[name]
            if w.state is State.DONE:
                violated(f"{w} was handed off")
            if w.surely_reserved(call.received):
                violated(f"{w} was handed off again while its reservations were surely live")
            if payload not in w.payloads:
                violated(f"{w} was handed off with {payload!r}, not one of {w.payloads}")
            self._check_first(w, call, served, "was handed off")
        for name, payload in handoffs:
            w = self.waiters[name]
            w.state, w.payloads, w.reserved_at = State.RESERVED, {payload}, call
            w.holds = {
                k: Window.granted(call, km.claim_timeout, self.keys[k].limit) for k in w.needs
            }

    def park_many(
        self,
        name: str,
        needs: dict[str, int],
        payload: bytes,
        arrival: float,
        lease: float,
        call: Call,
        outcome: Outcome,
        handoffs: Sequence[tuple[str, bytes]],
        key: str,
    ) -> list[Holding] | None:
        """``WaitingRoom.park_many`` of ``needs`` (key -> weight), through ``key``'s
        semaphore, answered ``outcome``. A waiter the model knows keeps its first arrival."""
        self._lapse_many(call.sent)
        w = self.waiters.get(name)
        if w is not None and w.state is State.UNSURE:
            raise ValueError("the test does not re-park a waiter the model is unsure of")
        fresh = w is None or w.state is State.DONE
        if fresh:
            w = Waiter(name, next(iter(needs)), arrival, {payload}, needs=dict(needs))
            w.since = call.sent
            w.unknown_holds(self.limits)
            self.waiters[name] = w
            for k in needs:
                self.keys[k].many = [v for v in self.keys[k].many if v.name != name] + [w]
        assert w is not None
        if outcome.kind not in ("slot", "parked"):
            violated(f"park_many of {w} answered {outcome.kind!r}")
        if outcome.kind == "slot" and fresh:  # no reservation of its own: it took free units
            for k, weight in needs.items():
                okm = self.keys[k]
                surely = okm.surely_live(call.received, excluding=w.holds[k])
                if surely + weight > okm.limit:
                    violated(f"park_many of {w} took {weight} of {k!r} while {surely} unit(s) "
                             f"were surely held, limit {okm.limit}")  # fmt: skip
        return self._many_answered(w, call, lease, outcome, handoffs, key, payload)

    def claim_many(
        self,
        name: str,
        call: Call,
        lease: float,
        outcome: Outcome,
        handoffs: Sequence[tuple[str, bytes]],
        key: str,
        delivery: str = "",
    ) -> list[Holding] | None:
        """``WaitingRoom.claim_many`` of waiter ``name``, through ``key``'s semaphore,
        answered ``outcome``."""
        self._lapse_many(call.sent)
        w = self.waiters[name]
        km = self.keys[key]
        if outcome.kind == "not waiting":
            known = self.deliveries.get(name, {None})
            if outcome.again and (not delivery or delivery not in known):
                violated(f"claim_many of {w} by {delivery!r} said again; recorded: {known}")
            if w.state in (State.PARKED, State.RESERVED):
                violated(f"claim_many of {w} found nothing while it waited")
            if w.state is State.UNSURE:
                w.finish("not waiting (after a call with no answer)", call.received)
            self._serve(km, call, handoffs, in_room=km.parked())
            return None
        if w.state is State.DONE:
            violated(f"claim_many of {w} answered {outcome.kind!r}")
        if w.state is State.UNSURE:
            w.state = State.PARKED
        return self._many_answered(w, call, lease, outcome, handoffs, key, None, delivery)

    def _many_answered(
        self,
        w: Waiter,
        call: Call,
        lease: float,
        outcome: Outcome,
        handoffs: Sequence[tuple[str, bytes]],
        key: str,
        payload: bytes | None,
        delivery: str = "",
    ) -> list[Holding] | None:
        """park_many (``payload``) or claim_many (None) of waiter ``w`` answered ``outcome``:
        it took a slot of every key, or waits on."""
        what = "claim_many" if payload is None else "park_many"
        if w.surely_reserved(call.received) and outcome.kind != "slot":
            violated(f"{what} of {w} answered {outcome.kind!r} while its reservations were live")
        if payload is not None:
            w.payloads = {payload}
        served = {n for n, _ in handoffs}
        held: list[Holding] | None = None
        if outcome.kind == "slot":
            if w.state is State.PARKED:  # not handed off: it was first everywhere just now
                self._check_first(w, call, served, "took its slots")
            if delivery:
                known = self.deliveries.setdefault(w.name, {None})
                if w.surely_reserved(call.received):
                    known.clear()
                known.add(delivery)
            w.finish("took its slots", call.received)
            group = f"g{len(self.holdings)}"
            held = [self._hold(k, call, outcome.token, lease, weight, group)
                    for k, weight in w.needs.items()]  # fmt: skip
        else:
            w.state = State.PARKED
            w.unknown_holds(self.limits)
        km = self.keys[key]
        self._serve(km, call, handoffs, in_room=km.parked(),
                    at_most=km.limit - km.surely_live(call.received))  # fmt: skip
        return held

    def blur_many(self) -> None:
        """A gather got no answer (its waiter is reserved in some room, and maybe nowhere in
        any room's order until that lapses): every waiter of several keys is unsure."""
        for w in self.waiters.values():
            if w.many and w.state is not State.DONE:
                w.state = State.UNSURE
                w.unknown_holds(self.limits)

    def _maybe_done_many(self, op: str, at: float, w: Waiter, lease: float, delivery: str) -> None:
        """A call about waiter ``w`` of several keys got no answer: it may have taken a slot
        of each, parked, or left."""
        if op in ("park", "claim"):  # a slot of each key for a token nobody knows
            for k, weight in w.needs.items():
                km = self.keys[k]
                km.phantoms.append((weight, Window.maybe(at + lease + MARGIN, km.limit)))
        if op == "park":
            self.waiters[w.name] = w
            for k in w.needs:
                km = self.keys[k]
                km.many = [v for v in km.many if v.name != w.name] + [w]
        if op == "claim" and delivery:
            self.deliveries.setdefault(w.name, {None}).add(delivery)
        if op in ("park", "claim", "cancel"):
            w.state = State.UNSURE
        for k in w.needs:
            self._blur_room(self.keys[k], at)

    # -- faults -------------------------------------------------------------------------

    def restart(self, at: float) -> None:
        """The server restarted without persistence at ``at``: everything is gone."""
        self.deliveries.clear()
        for km in self.keys.values():
            for _, win in km.windows():
                win.end(at)
            km.phantoms.clear()
            km.limit = km.code_limit  # the live limit was lost with the rest
            for w in [*km.waiters, *km.many]:
                if w.state is not State.DONE:
                    w.finish("lost in a restart", at)

    def unanswered(self, op: str, call: Call, **kw: object) -> None:
        """A call got no answer (``op`` as in test_model's rules). The server may run it up to
        the moment :meth:`settle` is called; what it may have done is recorded then."""
        self._unsettled.append(lambda at: self._maybe_done(op, call, at, **kw))

    def settle(self, at: float) -> None:
        """The server is answering again at ``at``: every call that got no answer before has
        run by now, or never will."""
        pending, self._unsettled = self._unsettled, []
        for apply in pending:
            apply(at)

    def _blur_room(self, km: KeyModel, at: float) -> None:
        """A call with no answer may have handed slots to any waiter of ``km`` without anyone
        publishing it: each may hold a reservation until ``at`` + the claim timeout."""
        until = at + km.claim_timeout + MARGIN
        for w in km.waiters:
            if w.state is State.DONE:
                continue
            if w.state is State.PARKED:
                w.state = State.RESERVED
            if w.reservation is None:
                w.reservation, w.reserved_at = Window.maybe(until, km.limit), None
            else:
                w.reservation.gone_after = max(w.reservation.gone_after, until)
        for w in km.many:  # may be reserved, kept, given back or handed off, unpublished
            if w.state is not State.DONE:
                w.unknown_holds(self.limits)

    def _maybe_done(self, op: str, call: Call, at: float, **kw: object) -> None:
        key = str(kw["key"])
        km = self.keys[key]
        lease = float(kw.get("lease", 0.0))  # type: ignore[arg-type]
        h = kw.get("holding")
        w = kw.get("waiter")
        if isinstance(w, Waiter) and w.many:
            return self._maybe_done_many(op, at, w, lease, str(kw.get("delivery") or ""))
        if op in ("acquire", "park", "claim"):  # a slot for a token nobody knows
            weight = int(kw.get("weight", 1))  # type: ignore[call-overload]
            km.phantoms.append((weight, Window.maybe(at + lease + MARGIN, km.limit)))
        if op == "extend" and isinstance(h, Holding) and not h.window.gone(call.sent):
            h.window.held_until = min(h.window.held_until, call.sent + lease - MARGIN)
            h.window.gone_after = max(h.window.gone_after, at + lease + MARGIN)
        if op in ("release", "force_release") and isinstance(h, Holding):
            h.window.blur()
        if op == "force_release" and isinstance(w, Waiter) and w.reservation is not None:
            w.reservation.blur()
        if op == "force_release_all":
            for _, win in km.windows():
                win.blur()
        if op == "park" and isinstance(w, Waiter):
            self.waiters[w.name] = w
            km.waiters = [v for v in km.waiters if v.name != w.name] + [w]
        if op == "claim" and isinstance(w, Waiter) and kw.get("delivery"):
            self.deliveries.setdefault(w.name, {None}).add(str(kw["delivery"]))
        if op in ("park", "claim", "cancel") and isinstance(w, Waiter):
            w.state = State.UNSURE
            if w.reservation is not None:
                w.reservation.blur()
        if op in ("park", "claim") and km.grace > 0:  # it may have taken one past its grace
            for v in km.waiters:
                if v.reservation is not None:
                    v.reservation.blur()
        if op in ("park", "claim", "cancel", "release", "sweep", "set_limit"):
            self._blur_room(km, at)

    def recovered(self, handoffs: Sequence[tuple[str, bytes]], at: float) -> None:
        """What the recovery of calls with no answer published by ``at`` (core/recovery.py):
        the reservations those calls may have made, and the slots handed off when it ran.
        Not checked for order: which call made each is unknown."""
        claim = max(km.claim_timeout for km in self.keys.values())
        for name, payload in handoffs:
            w = self.waiters.get(name)
            if w is None or w.state is State.DONE:
                violated(f"the recovery handed off {name!r}, not waiting")
            if payload not in w.payloads:
                violated(f"the recovery handed off {w} with {payload!r}, not one of {w.payloads}")
            w.state, w.payloads = State.RESERVED, {payload}
            if w.many:
                w.unknown_holds(self.limits)
            elif w.reservation is None:
                w.reservation = Window.maybe(at + claim + MARGIN, self.keys[w.key].limit)
            else:
                w.reservation.gone_after = max(w.reservation.gone_after, at + claim + MARGIN)

    # -- what Redis reports -------------------------------------------------------------

    def check_limits(self, at: float) -> None:
        """The slots surely held never exceed a key's limit."""
        self._lapse_many(at)
        for km in self.keys.values():
            surely, ceiling = km.surely_live(at), km.ceiling(at, surely=True)
            if surely > ceiling:
                violated(
                    f"{surely} units of {km.name!r} are surely held, limit {km.limit} (the "
                    f"highest a live grant was made under: {ceiling})"
                )

    def observe_count(self, key: str, call: Call, count: int, available: int) -> None:
        """``count(key)`` and ``available(key)``, read in ``call``."""
        km = self.keys[key]
        self._lapse_many(call.sent)
        surely, maybe = km.surely_live(call.received), km.maybe_live(call.sent)
        ceiling = km.ceiling(call.sent, surely=False)
        if count > ceiling:
            violated(
                f"count({key!r}) is {count}, over the limit {km.limit} (at most {ceiling}); "
                + km.describe(call.sent)
            )
        if not surely <= count <= maybe:
            violated(
                f"count({key!r}) is {count}, the model says {surely} to {maybe}; "
                + km.describe(call.sent)
            )
        low, high = max(0, km.limit - maybe), max(0, km.limit - surely)
        if not low <= available <= high:
            violated(f"available({key!r}) is {available}, the model says {low} to {high}")

    def observe_holders(self, key: str, call: Call, holders: Sequence[tuple[str, str]]) -> None:
        """``holders(key)`` read in ``call``: (token, ``reserved_for`` or "") of each."""
        km = self.keys[key]
        tokens = [t for t, _ in holders]
        if len(tokens) > km.ceiling(call.sent, surely=False):
            violated(f"holders({key!r}) lists {len(tokens)} holders, over the limit {km.limit}")
        if len(set(tokens)) != len(tokens):
            violated(f"holders({key!r}) lists a token twice: {tokens}")
        self._lapse_many(call.sent)
        by_token = {h.token: h for h in km.holdings}
        waiters = {f"~{w.name}": w for w in [*km.waiters, *km.many]}
        unknown = 0
        for token, reserved_for in holders:
            h = by_token.get(token)
            w = waiters.get(token)
            if h is not None:
                if h.window.gone(call.sent):
                    violated(f"holders({key!r}) lists {h}, {h.window.describe(call.sent)}")
            elif w is not None:
                window = w.holds.get(key) if w.many else w.reservation
                if window is None or window.gone(call.sent):
                    violated(f"holders({key!r}) lists a reservation for {w}, never handed off")
                if reserved_for != w.name:
                    violated(f"reservation {token} of {key!r} is reserved for {reserved_for!r}")
            else:
                unknown += 1
        phantoms = sum(not p.gone(call.sent) for _, p in km.phantoms)
        if unknown > phantoms:
            violated(
                f"holders({key!r}) lists {unknown} token(s) the model does not know; at most "
                f"{phantoms} call(s) with no answer may have taken a slot"
            )
        listed = set(tokens)
        for h in km.holdings:
            if h.window.held(call.received) and h.token not in listed:
                violated(f"holders({key!r}) misses {h}, {h.window.describe(call.received)}")
        for w in [*km.waiters, *km.many]:
            if w.surely_reserved(call.received) and f"~{w.name}" not in listed:
                violated(f"holders({key!r}) misses the live reservation of {w}")

    def observe_room(self, key: str, call: Call, room: Sequence[str], parked: set[str]) -> None:
        """The room of ``key`` (waiter ids, oldest first) and the waiter ids in its parked
        hash, read in ``call``: nobody is lost, and the room keeps arrival order."""
        km = self.keys[key]
        self._lapse_many(call.sent)
        mine = {w.name: w for w in [*km.waiters, *km.many]}
        for name in room:
            w = mine.get(name)
            if w is None:
                violated(f"the room of {key!r} holds {name!r}, never parked there")
            if w.state is State.DONE:
                violated(f"the room of {key!r} still holds {w}")
            if w.surely_reserved(call.received):
                violated(f"the room of {key!r} holds {w} while its reservation is live")
        arrivals = [mine[name].arrival for name in room]
        if arrivals != sorted(arrivals):
            violated(f"the room of {key!r} is not in arrival order: {list(room)}")
        for w in [*km.waiters, *km.many]:
            if w.state is State.PARKED and w.name not in room and not w.many:
                violated(f"{w} is missing from the room {list(room)}")
            if w.state in (State.PARKED, State.RESERVED) and w.name not in parked:
                violated(f"{w} is lost: it is not in the parked hash")
            if w.state is State.DONE and w.name in parked:
                violated(f"{w} is still in the parked hash")

    def observe_orders(
        self, call: Call, rooms: dict[str, Sequence[str]], reserved: dict[str, set[str]],
        passive: dict[str, set[str]],
    ) -> None:  # fmt: skip
        """Each key's room, the waiters it holds a reservation for, and those of several keys
        passive there, read in ``call``: a waiter of several keys that waits is in the order
        of one of its rooms at least, holds a reservation there, or is waiting to be put back
        by a sweep there (its reservation pruned by a plain acquire); never passive in every
        room it holds nothing of, where nobody would ever serve it."""
        for w in self.waiters.values():
            if not w.many or w.state is not State.PARKED:
                continue
            if not any(w.name in rooms[k] or w.name in reserved[k] or w.name not in passive[k]
                       for k in w.needs):  # fmt: skip
                violated(f"{w} waits in no room's order: passive wherever it holds nothing")
