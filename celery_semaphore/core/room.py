"""The waiting room: runs that found their key full wait here, in Redis, in arrival order.
A waiter *parks* with its payload; a release reserves the freed slot for the oldest and hands
the payload to the :class:`~.handoff.HandoffRoute`; the waiter's run *claims* it; a *sweep*
is the safety net. A :class:`~.semaphore.Semaphore` owns a :class:`WaitingRoom`
(``sem.room``). The Lua: ``room.lua`` (shared steps), ``park.lua``, ``park_many.lua``,
``sweep.lua``, ``cancel.lua``, ``waiting.lua``, ``recover.lua``; ``many.lua`` and
``gather.lua`` for waiters of several keys."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from redis import Redis, RedisCluster

from . import validation as check
from .admin import DEFAULT_PREFIX
from .calls import (
    Place,
    claim_call,
    park_call,
    park_many_call,
    room_settings,
    sweep_call,
    take_call,
    waiting_call,
)
from .group import SlotGroup
from .handoff import DEFAULT_CLAIM_TIMEOUT, HandoffRoute
from .names import Keys, Namespace
from .options import DEFAULT_LEASE, HolderRecord, KeySpecs, many_args
from .process import member_of, new_token
from .rates import RateSpec, rated
from .recovery import recover_later, recovering
from .replies import Admitted, Early, Handoff, NotWaiting, Parked, RoomFull, Waiter
from .room_index import RoomIndex, give_up_ms
from .scripts import REDIS_ERRORS, Scripts, backend_error, backend_errors
from .slot import Slot
from .tracing import Record, acquire_span
from .validation import check_delivery, check_waiter, deadline_ms, park_args

DEFAULT_ROOM_TTL = 24 * 3600.0
"""Seconds a room outlives its last touch (a park, claim, release into it, sweep)."""
# The ``semaphore.outcome`` of a park or claim's span (see .tracing).
OUTCOMES = {Admitted: "acquired", Parked: "parked", RoomFull: "room full", NotWaiting: "none",
            Early: "early"}  # fmt: skip
ROOMS_KEPT = 4096  # keys a room remembers as having waiters (then it forgets them all)
MAX_IDLE_MS = 2**31 - 1
"""The longest idle a sweep is asked for (about 25 days): sweep.lua caps it at a quarter of
each room's TTL."""


class _Ask(NamedTuple):
    """A park's or claim's checked arguments: ``slot`` is what every room script that takes
    a slot is sent first (keys, limit, lease in ms, token, weight)."""

    key: str
    slot: tuple[Keys, int, int, str, int]
    lease: float
    arrival_ms: int | None
    max_queued: int
    ttl_ms: int


class WaitingRoom:
    """The waiting rooms of every semaphore key under ``prefix``.

    Args:
        client (redis.Redis | redis.RedisCluster): where the rooms live.
        prefix (str): the keys' namespace (default ``"semaphore"``).
        handoffs (HandoffRoute | None): where the slots its calls reserve go; None: they
            lapse, and a sweep by a process that can publish hands them out again.
        limit (int | None): the limit of a park or claim that gives none (None: required).
        lease (float): seconds a slot taken by a park or claim lives without an extend,
            unless the call says otherwise. Default 60.0.
        scripts (Scripts | None): the registered scripts to send through (a
            :class:`~celery_semaphore.Semaphore` shares its own); None: its own.

    Raises:
        SemaphoreValidationError: an argument is invalid.
    """

    def __init__(
        self,
        client: Redis,
        prefix: str = DEFAULT_PREFIX,
        handoffs: HandoffRoute | None = None,
        *,
        limit: int | None = None,
        lease: float = DEFAULT_LEASE,
        scripts: Scripts | None = None,
    ) -> None:
        self.client = client
        self.names = Namespace(check.check_key(prefix, "prefix"), isinstance(client, RedisCluster))
        self.handoffs = handoffs or HandoffRoute(DEFAULT_CLAIM_TIMEOUT, None)
        self.limit = None if limit is None else check.check_limit(limit)
        check.lease_ms(lease)
        self.lease = float(lease)
        self._scripts = scripts or Scripts(client)
        self._record = HolderRecord(self.limit or 1)
        self.index = RoomIndex(client, self.names, self._scripts)
        self._rooms: set[str] = set()  # keys a park last found with waiters

    def __repr__(self) -> str:
        return f"<WaitingRoom prefix={self.names.prefix!r} limit={self.limit}>"

    def park(
        self,
        key: str,
        waiter: str,
        payload: bytes | Callable[[], bytes],
        *,
        limit: int | None = None,
        weight: int = 1,
        tenant: str = "",
        head_start: float = 0.0,
        rates: RateSpec = None,
        units: Mapping[str, int] | None = None,
        arrival: float | None = None,
        lease: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        max_queued: int = 0,
        room_ttl: float = DEFAULT_ROOM_TTL,
        deadline: float | None = None,
        waited: float | None = None,
        budget: float | None = None,
    ) -> Slot | Parked | RoomFull:
        """Take a slot of ``key`` in arrival order, or park ``waiter`` in its waiting room.

        The waiter joins the room first, so a free slot goes to it only when no older waiter
        is parked. A release that frees a slot reserves it for the oldest waiter and passes
        its ``payload`` to the hand-off route's publisher, whose run calls :meth:`claim`. A
        waiter parked again keeps its first arrival, and gets the new payload.

        Args:
            key (str): the semaphore's key.
            waiter (str): the waiter's id, unique among the key's waiters (a Celery task id);
                must not start with ``~`` or ``!`` nor hold a ``#``.
            payload (bytes | Callable[[], bytes]): what the publisher gets to start the
                waiter again (opaque), or a function that makes it only if the waiter is to
                park (then a key with no waiters when last seen is first tried without it).
            limit (int | None): the key's limit (None: the room's); the room hands slots out
                by the limit its last parked waiter gave (or by a live limit, when set).
            weight (int): units of the limit the waiter takes (1 to ``limit``). The room
                serves waiters in strict order: a heavy waiter at its head waits for room
                enough, and lighter ones behind it are not served first.
            tenant (str): the waiter's tenant for fair turns ("" for none): it parks one
                past its tenant's last turn, never before the room's head (see the
                waiting-room how-to). Give every waiter of a key a tenant, or none.
            head_start (float): its priority: seconds (0 to a day) it parks ahead of its
                arrival or turn, passing waiters that came less than that before it, never
                an older one. A re-park keeps its place.
            rates (RateSpec): the key's start rates (see :mod:`.rates`): the waiter
                starts only when every rate allows it, handed a slot for that instant.
            units (Mapping[str, int] | None): its units of each rate (default: the rate's).
            arrival (float | None): epoch seconds when the waiter first asked, by the
                caller's clock; None: now, by the server's.
            lease (float | None): lease of a slot taken now; None: the room's.
            metadata (Mapping[str, Any] | None): JSON-serialisable facts about the holder,
                as for :meth:`Semaphore.acquire`.
            max_queued (int): refuse to park a new waiter past this many (0: no limit).
            room_ttl (float): seconds an idle room lives before Redis expires it.
            deadline (float | None): epoch seconds after which a newly parked waiter gives
                up (a sweep publishes its payload marked ``give_up``; its run should
                :meth:`cancel` itself and fail); None: never. A re-park keeps the first.
            waited (float | None): seconds it asked before this call, in place of
                ``arrival``: it arrived that long before the server's now.
            budget (float | None): in place of ``deadline``, seconds from its arrival to
                giving up, judged by the server's clock alone (a skewed caller's is moot).

        Returns:
            Slot | Parked | RoomFull: the slot (the caller must release it), or where the
            waiter stands, or a refusal because the room is full.

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        make = payload if callable(payload) else None
        check_waiter(waiter, b"" if make is not None else payload)
        if tenant != "":
            check.check_key(tenant, "tenant")
        # No rate and no units (most runs): nothing to check or encode again, per run.
        ahead_ms, (rates_arg, units_arg) = check.head_start_ms(head_start), (
            rated(rates, units) if units or rates not in (None, ()) else ("", ""))  # fmt: skip
        deadline_at = deadline_ms(deadline, budget)
        ask = self._ask(key, limit, weight, lease, metadata, room_ttl, arrival, max_queued, waited)
        with self._round_trip(ask) as record:
            if make is not None and ask.key not in self._rooms and not rates_arg:
                sent_at = time.monotonic()
                taken = self._scripts.run(take_call(*ask.slot))
                if isinstance(taken, Admitted):
                    record(1, OUTCOMES[Admitted])
                    return self._slot(ask, taken, sent_at)
            if make is not None:
                payload = make()
                check_waiter(waiter, payload)
            assert isinstance(payload, bytes)
            place = Place(ask.arrival_ms, deadline_at, ask.max_queued, tenant, ahead_ms,
                          rates_arg, units_arg)  # fmt: skip
            sent_at = time.monotonic()
            result, handed = self._scripts.run(
                park_call(*ask.slot, waiter, payload, self._settings(ask), place)
            )
            record(1, OUTCOMES[type(result)])
        self._after(ask, result, handed, deadline_at)
        return self._slot(ask, result, sent_at) if isinstance(result, Admitted) else result

    def claim(
        self,
        key: str,
        waiter: str,
        *,
        limit: int | None = None,
        weight: int = 1,
        lease: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        room_ttl: float = DEFAULT_ROOM_TTL,
        delivery: str = "",
    ) -> Slot | Parked | NotWaiting:
        """Take the slot a hand-off reserved for ``waiter`` (its run has started).

        Its other arguments are :meth:`park`'s (``weight`` the one the waiter parked with).
        A reservation for a start rate's instant still to come is waited for (sleeping).

        Args:
            delivery (str): an id of the message that started this run (each publish of a
                hand-off gets its own), recorded with the claim: if the same message is
                delivered again, its run was lost, and :class:`NotWaiting` says ``again``.

        Returns:
            Slot | Parked | NotWaiting: the slot; :class:`Parked`: the reservation lapsed and
            the waiter is back in the room (end the run; a hand-off starts it again);
            :class:`NotWaiting`: nothing for it, a duplicate copy (end it quietly) or, with
            ``again``, the same delivery once more (its run was lost: run it).

        Errors as :meth:`park`.
        """
        check_delivery(delivery)
        check_waiter(waiter, b"")
        ask = self._ask(key, limit, weight, lease, metadata, room_ttl)
        call = claim_call(*ask.slot, waiter, delivery, self._settings(ask))
        while True:
            with self._round_trip(ask) as record:
                sent_at = time.monotonic()
                result, handed = self._scripts.run(call)
                record(1, OUTCOMES[type(result)])
            if not isinstance(result, Early):
                break
            time.sleep(result.wait_ms / 1000)
        self._after(ask, result, handed, 0)
        return self._slot(ask, result, sent_at) if isinstance(result, Admitted) else result

    def _ask(
        self, key: str, limit: int | None, weight: int, lease: float | None,
        metadata: Mapping[str, Any] | None, room_ttl: float, arrival: float | None = None,
        max_queued: int = 0, waited: float | None = None,
    ) -> _Ask:  # fmt: skip
        """A park's or claim's arguments, checked (nothing is sent)."""
        key = check.check_key(key)
        seconds, ms, arrival_ms, max_queued, ttl_ms = park_args(
            lease, self.lease, arrival, max_queued, room_ttl, waited
        )
        limit = check.room_limit(limit, self.limit)
        weight = check.check_weight(weight, limit)
        # The holder's record rides in its member (see process.member_of), not in a hash.
        token = member_of(self._record.encode(metadata, limit, weight))
        return _Ask(key, (self.names.keys_of(key), limit, ms, token, weight), seconds,
                    arrival_ms, max_queued, ttl_ms)  # fmt: skip

    def _settings(self, ask: _Ask) -> str:
        """The room's settings for ``ask``'s park or claim (see :func:`room_settings`)."""
        return room_settings(self.handoffs.claim_ms, ask.ttl_ms, self.handoffs.grace_ms)

    @contextlib.contextmanager
    def _round_trip(self, ask: _Ask) -> Iterator[Record]:
        """One room call's span, its Redis errors as :class:`SemaphoreBackendError`, and the
        recovery of a call whose answer is lost."""
        keys, limit, _, token, _ = ask.slot
        with (
            acquire_span(ask.key, limit) as record,
            backend_errors(ask.key, limit),
            recovering(self._scripts, keys, ask.key, token, self.handoffs),
        ):
            yield record

    def _after(
        self, ask: _Ask, result: Admitted | Parked | RoomFull | NotWaiting,
        handed: list[Handoff], deadline: int,
    ) -> None:  # fmt: skip
        """Deliver a park's or claim's hand-offs, and note where its waiter stands."""
        # A take of a key remembered with waiters is not tried: it would find them.
        waiters = not (isinstance(result, Admitted) and result.roomless)
        if waiters and len(self._rooms) >= ROOMS_KEPT:
            self._rooms.clear()
        (self._rooms.add if waiters else self._rooms.discard)(ask.key)
        self.handoffs.deliver(ask.key, handed, self._scripts)
        if isinstance(result, Parked):
            self.index.add(ask.key, ask.ttl_ms, result.position == 0,
                           give_up_ms(deadline, ask.arrival_ms, result.now_ms))  # fmt: skip

    def park_many(
        self,
        keys: KeySpecs,
        waiter: str,
        payload: bytes,
        *,
        arrival: float | None = None,
        lease: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        max_queued: int = 0,
        room_ttl: float = DEFAULT_ROOM_TTL,
        deadline: float | None = None,
        waited: float | None = None,
        budget: float | None = None,
    ) -> SlotGroup | Parked | RoomFull:
        """Take a slot of every key in arrival order, all in one script call, or park
        ``waiter`` in the room of every key at once, keeping its place in each; it is handed
        off once it holds a reservation of every key (see the several-keys how-to), and its
        run calls :meth:`claim_many`.

        Args:
            keys (KeySpecs): ``(key, limit[, weight])`` of each key, as for
                :meth:`Semaphore.acquire_many`.
            payload (bytes): as for :meth:`park`, as are ``waiter``, ``arrival``, ``lease``,
                ``metadata``, ``room_ttl``, ``deadline``, ``waited`` and ``budget``;
                ``max_queued`` counts each room it would wait in.

        Returns:
            SlotGroup | Parked | RoomFull: the slots; or where the waiter stands
            (``Parked.index`` is the 1-based first key whose order it waits in); or a
            refusal, that room being full.

        Errors as :meth:`park`.
        """
        result = self._many(keys, waiter, payload, arrival, lease, metadata, max_queued,
                            room_ttl, False, deadline_ms(deadline, budget), "", waited)  # fmt: skip
        assert not isinstance(result, NotWaiting)
        return result

    def claim_many(
        self,
        keys: KeySpecs,
        waiter: str,
        *,
        lease: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        room_ttl: float = DEFAULT_ROOM_TTL,
        delivery: str = "",
    ) -> SlotGroup | Parked | NotWaiting:
        """Take every key with the units a hand-off reserved for ``waiter``, or wait on
        in their rooms; see :meth:`park_many` and, for the answers, :meth:`claim`.

        Errors as :meth:`park`.
        """
        check_delivery(delivery)
        result = self._many(keys, waiter, b"", None, lease, metadata, 0, room_ttl, True, 0,
                            delivery, None)  # fmt: skip
        assert not isinstance(result, RoomFull)
        return result

    def _many(
        self, keys: KeySpecs, waiter: str, payload: bytes, arrival: float | None,
        lease: float | None, metadata: Mapping[str, Any] | None, max_queued: int,
        room_ttl: float, claim_only: bool, deadline: int, delivery: str,
        waited: float | None,
    ) -> SlotGroup | Parked | RoomFull | NotWaiting:  # fmt: skip
        specs = many_args(keys)
        check_waiter(waiter, payload)
        seconds, ms, arrival_ms, max_queued, ttl_ms = park_args(
            lease, self.lease, arrival, max_queued, room_ttl, waited
        )
        info = self._record.encode(metadata, specs[0][1], specs[0][2])
        all_keys = self.names.keys_of_many([key for key, _, _ in specs])
        groups = [(k, limit, weight) for k, (_, limit, weight) in zip(all_keys, specs, strict=True)]
        token = new_token()
        label = "+".join(key for key, _, _ in specs)
        sent_at = time.monotonic()
        with (
            acquire_span(label, specs[0][1], [key for key, _, _ in specs]) as record,
            backend_errors(label, specs[0][1]),
            recovering(self._scripts, all_keys[0], label, token, self.handoffs),
        ):
            result, handed = self._scripts.run(park_many_call(
                groups, ms, token, info, waiter, arrival_ms, payload, self.handoffs.claim_ms,
                ttl_ms, max_queued, claim_only, deadline, delivery,
            ))  # fmt: skip
            record(1, OUTCOMES[type(result)])
        self.handoffs.deliver(label, handed, self._scripts)
        if isinstance(result, Parked):  # it waits in every key's room
            due_ms = give_up_ms(deadline, arrival_ms, result.now_ms)
            for key, _, _ in specs:
                self.index.add(key, ttl_ms, due_ms=due_ms)
        if isinstance(result, Admitted):
            return SlotGroup(
                [Slot(self._scripts, k, key, limit, token, seconds,
                      Admitted(result.expires_at_ms, result.now_ms, limit), sent_at,
                      self.handoffs, weight)
                 for k, (key, limit, weight) in zip(all_keys, specs, strict=True)]
            )  # fmt: skip
        return result

    def cancel(self, key: str, waiter: str) -> bool:
        """Take ``waiter`` out of ``key``'s room (its run was revoked or expired), its
        reservation, if any, to the next waiter; a waiter of several keys out of all of
        their rooms at once. True when it was there.

        Raises:
            SemaphoreValidationError: ``key`` or ``waiter`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        keys = self.names.keys_of(check.check_key(key))
        check.check_key(waiter, "waiter")
        with backend_errors(key), recovering(self._scripts, keys, key, "", self.handoffs):
            found, handed = self._scripts.cancel(keys, waiter, self.handoffs.claim_ms)
        self.handoffs.deliver(key, handed, self._scripts)
        return found

    def sweep(self, key: str) -> int:
        """The safety net of ``key``'s room: requeue waiters whose reservation lapsed, hand
        free slots to the oldest, give up those past their deadline (see :meth:`park`), take
        a room found gone out of the index: how many were handed off and given up.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        return self.sweep_many([key])

    def sweep_many(self, keys: Sequence[str], idle: float | None = None,
                   taken_ms: int | None = None) -> int:  # fmt: skip
        """:meth:`sweep` the rooms of ``keys`` in one round trip: every ``sweep.lua`` call in
        one pipeline (each still atomic on its own), then each room's hand-offs delivered,
        each room found gone taken out of the :attr:`index`, and every other room scored in it
        with when it next needs a sweep, in one more round trip.

        A worker sweeps the rooms due a page at a time (see :meth:`.room_index.RoomIndex.due`):
        one call per room, each its own round trip, would cost a worker's share of the rooms
        its round-trip time each (a millisecond or more on a busy host, where the script itself
        takes a tenth of that). A room where nothing can fall due is swept once per ``idle``
        seconds, which only keeps its keys alive, since whatever could fall due in it later
        brings its sweep on itself (see sweep.lua).

        Args:
            keys (Sequence[str]): the semaphore keys whose rooms to sweep.
            idle (float | None): the most seconds a room may go unswept when nothing in it
                falls due sooner (None, or more than a quarter of the room's TTL: that quarter,
                so that the sweeps keep the room's keys alive).
            taken_ms (int | None): the score every room of ``keys`` was given in the index when
                it was taken to sweep (:meth:`.room_index.RoomIndex.due`); None: the rooms'
                scores are read first (one more round trip), so that a room whose score a mark
                lowered meanwhile keeps it.

        Returns:
            int: how many slots were handed off and waiters given up, in every room.

        Raises:
            SemaphoreValidationError: a key is not a non-empty str (nothing is sent).
            SemaphoreBackendError: Redis failed: the round trip (each room's call is then put
                right once the store answers, as a single sweep's would be), or one room's call
                or removal from the index (the other rooms are swept all the same; the first
                such error is raised once they are).
        """
        rooms = [(key, self.names.keys_of(check.check_key(key))) for key in keys]
        if not rooms:
            return 0
        claim_ms = self.handoffs.claim_ms
        idle_ms = MAX_IDLE_MS if idle is None else max(1, min(MAX_IDLE_MS, round(idle * 1000)))
        taken = self.index.scores([key for key, _ in rooms]) if taken_ms is None else None
        sent_at = time.monotonic()
        try:
            answers = self._scripts.run_many([sweep_call(k, claim_ms, idle_ms) for _, k in rooms])
        except REDIS_ERRORS as exc:
            for key, k in rooms:
                recover_later(self._scripts, k, key, "", self.handoffs, sent_at, exc)
            named = rooms[0][0] if len(rooms) == 1 else f"{rooms[0][0]} and {len(rooms) - 1} more"
            raise backend_error(exc, named, None) from exc
        failed: Exception | None = None
        handed = 0
        next_due: list[tuple[str, int, int]] = []
        for n, ((key, _), answer) in enumerate(zip(rooms, answers, strict=True)):
            try:
                if isinstance(answer, Exception):
                    raise backend_error(answer, key, None) from answer
                alive, found, next_ms = answer
                was = taken_ms if taken is None else taken[n]
                if alive and was is not None:
                    next_due.append((key, was, next_ms))
                handed += self.handoffs.deliver(key, found, self._scripts)
                if not alive:
                    self.index.drop(key)
            except Exception as exc:
                failed = failed or exc
        try:
            self.index.reschedule(next_due)
        except Exception as exc:  # the rooms stay due one interval on: swept sooner, not later
            failed = failed or exc
        if failed is not None:
            raise failed
        return handed

    def outlives(self, key: str, holder: str) -> bool:
        """Whether the run holding ``key``'s slot ``holder`` (a claim's
        :attr:`NotWaiting.holder`) is alive: True once it renews the slot, False once the
        slot is released, freed or lapses (its run ended, or was lost). Looks four times a
        second, so it waits at most one renewal interval for a live run, and one lease for a
        lost one.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        slots = self.names.keys_of(check.check_key(key)).slots
        with backend_errors(key):
            first = self.client.zscore(slots, holder)
            while first is not None:
                seconds, micros = self.client.time()
                score = self.client.zscore(slots, holder)
                if score is None or score <= seconds * 1000 + micros // 1000:
                    return False
                if score > first:
                    return True
                time.sleep(0.25)
        return False

    def waiters(self, key: str) -> list[Waiter]:
        """The waiters parked on ``key``, oldest first (not those holding a reservation, nor
        waiters of several keys that let it serve others first). Errors as :meth:`head`."""
        return self._waiting(key, -1)[1]

    def head(self, key: str) -> tuple[int, Waiter | None]:
        """How many waiters are parked on ``key``, and the oldest (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        count, head = self._waiting(key, 0)
        return count, (head[0] if head else None)

    def _waiting(self, key: str, last: int) -> tuple[int, list[Waiter]]:
        keys = self.names.keys_of(check.check_key(key))
        with backend_errors(key):
            now_ms, count, rows = self._scripts.run(waiting_call(keys, last))
        return count, [Waiter(w, arrival / 1000, (now_ms - arrival) / 1000) for w, arrival in rows]

    def _slot(self, ask: _Ask, admitted: Admitted, sent_at: float) -> Slot:
        keys, limit, _, token, weight = ask.slot
        return Slot(self._scripts, keys, ask.key, limit, token, ask.lease, admitted, sent_at,
                    self.handoffs, weight)  # fmt: skip
