"""Parking: the waiting-room methods of :class:`~celery_semaphore.core.semaphore.Semaphore`
(park a waiter, claim a handed-off slot); see :mod:`celery_semaphore.core.room`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ..errors import SemaphoreBackendError, SemaphoreValidationError
from . import validation as check
from .admin import SemaphoreAdmin
from .process import new_token
from .room import DEFAULT_ROOM_TTL, HandoffRoute
from .scripts import (
    Admitted,
    Declined,
    Full,
    Keys,
    NotWaiting,
    Parked,
    RoomFull,
    Scripts,
    backend_errors,
)
from .slot import Slot
from .tracing import acquire_span

OUTCOMES = {Admitted: "acquired", Parked: "parked", RoomFull: "room full", NotWaiting: "none"}
"""The ``semaphore.outcome`` of a park or claim's span (see :mod:`.tracing`)."""

ROOMS_KEPT = 4096
"""Keys a semaphore remembers as having a waiting room (then it forgets them all)."""

MAX_BLOCK = 2.0
"""Longest single BLPOP, seconds: under the 5 s socket timeout of clients made from a URL."""


def check_waiter(waiter: object, payload: object) -> None:
    """Refuse a waiter id the room cannot tell apart from its own marks, or a payload that is
    not bytes.

    Raises:
        SemaphoreValidationError: ``waiter`` is empty, starts with ``~`` or ``!`` or holds a
            ``#``, or ``payload`` is not bytes.
    """
    waiter = check.check_key(waiter, "waiter")
    if waiter[0] in "~!" or "#" in waiter:
        raise SemaphoreValidationError(
            f"waiter must not start with ~ or ! nor contain #, got {waiter!r}"
        )
    if not isinstance(payload, bytes):
        raise SemaphoreValidationError(f"payload must be bytes, got {type(payload).__name__}")


class ParkArgs(NamedTuple):
    """A park's timing arguments, checked (see :func:`park_args`)."""

    seconds: float
    ms: int
    arrival_ms: int | None
    max_queued: int
    ttl_ms: int


def park_args(
    lease: float | None, default_lease: float, arrival: float | None, max_queued: int,
    room_ttl: float,
) -> ParkArgs:  # fmt: skip
    """The lease (seconds and ms), arrival (epoch ms), room size and room TTL (ms) of a park
    or claim, checked.

    Raises:
        SemaphoreValidationError: one of them is invalid; the message names it.
    """
    arrival_ms = None if arrival is None else round(check.check_epoch(arrival, "arrival") * 1000)
    seconds, ms, queued, ttl_ms = _park_timing(lease, default_lease, max_queued, room_ttl)
    return ParkArgs(seconds, ms, arrival_ms, queued, ttl_ms)


def _check_park_timing(
    lease: float | None, default_lease: float, max_queued: int, room_ttl: float
) -> tuple[float, int, int, int]:
    seconds = default_lease if lease is None else lease
    return (float(seconds), check.lease_ms(seconds), check.check_retries(max_queued, "max_queued"),
            check.lease_ms(room_ttl, "room_ttl"))  # fmt: skip


_park_timing = check.Memoised(_check_park_timing)
"""A park's lease, room size and room TTL checked, once per distinct value."""


class WaitingRoom:
    """The waiting-room methods of :class:`~celery_semaphore.core.semaphore.Semaphore`.

    The attributes and the three methods below are :class:`Semaphore`'s own, declared here
    so that the room's methods type-check on their own.
    """

    limit: int
    lease: float
    handoffs: HandoffRoute
    admin: SemaphoreAdmin
    client: Any
    _scripts: Scripts
    _rooms: set[str]
    """Keys a park last found with a waiting room (see :meth:`park`'s payload)."""

    def _redis_keys(self, key: str) -> Keys:
        raise NotImplementedError

    def _metadata(
        self, metadata: Mapping[str, Any] | None, limit: int | None = None, weight: int = 1
    ) -> str:
        raise NotImplementedError

    def _limit(self, limit: int | None) -> int:
        raise NotImplementedError

    def _slot(
        self,
        keys: Keys,
        key: str,
        token: str,
        lease: float,
        admitted: Admitted,
        sent_at: float,
        weight: int = 1,
    ) -> Slot:
        raise NotImplementedError

    def park(
        self,
        key: str,
        waiter: str,
        payload: bytes | Callable[[], bytes],
        *,
        limit: int | None = None,
        weight: int = 1,
        group: str = "",
        arrival: float | None = None,
        lease: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        max_queued: int = 0,
        room_ttl: float = DEFAULT_ROOM_TTL,
        deadline: float | None = None,
    ) -> Slot | Parked | RoomFull:
        """Take a slot of ``key`` in arrival order, or park ``waiter`` in its waiting room.

        The waiter joins the room first, so a free slot goes to it only when no older waiter
        is parked. Parked, it waits for a release to hand it a slot: the releasing process
        reserves the slot for it and passes ``payload`` to ``on_handoff``, which starts the
        waiter's run again; that run calls :meth:`claim`. Parking a waiter that is already
        parked keeps its first arrival and replaces its payload.

        Args:
            key (str): the semaphore's key.
            waiter (str): the waiter's id, unique among the key's waiters (a Celery task id);
                must not start with ``~`` or ``!``.
            payload (bytes | Callable[[], bytes]): what ``on_handoff`` gets to start the
                waiter again (opaque); or a function that makes it, called only if the
                waiter is to park. Then, on a key that had no waiting room when this
                semaphore last looked, a free slot is taken without the payload (one
                round trip; a second, with it, when that key turns out to have a room).
            limit (int | None): as for :meth:`acquire`; the room hands slots out by the
                limit its last parked waiter gave (or by a live limit, when one is set).
            weight (int): as for :meth:`acquire`. The room serves waiters in strict order:
                a heavy waiter at its head waits for room enough, and lighter ones behind
                it are not served first.
            group (str): a fair-turn group (a tenant, say), or "" for none. A waiter of a
                group parks at its group's next turn rather than at its arrival: one past
                the group's last turn, and no earlier than the room's head. A group with a
                long backlog then takes turns with one that just arrived, instead of
                serving its whole backlog first. Give every waiter of a key a group, or
                none: a waiter without one stands at its arrival time, behind every turn
                handed out before it.
            arrival (float | None): epoch seconds when the waiter first asked; None: now.
            lease (float | None): lease of a slot taken now; None: the semaphore's.
            metadata (Mapping[str, Any] | None): as for :meth:`acquire`.
            max_queued (int): refuse to park a new waiter past this many (0: no limit).
            room_ttl (float): seconds an idle room lives before Redis expires it.
            deadline (float | None): epoch seconds after which a newly parked waiter gives
                up: a sweep (:meth:`SemaphoreAdmin.sweep`) then passes its payload to
                ``on_handoff`` marked ``give_up``, and its run should :meth:`cancel` itself
                and fail. None: it waits as long as it takes. A waiter parked again keeps
                its first deadline.

        Returns:
            Slot | Parked | RoomFull: the slot (the caller must release it), or where the
            waiter stands, or a refusal because the room is full.

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        if deadline is not None:
            check.check_epoch(deadline, "deadline")
        result = self._park(
            key, waiter, payload, arrival, lease, metadata, max_queued, room_ttl,
            claim_only=False, deadline_ms=0 if deadline is None else round(deadline * 1000),
            limit=limit, weight=weight, group=group,
        )  # fmt: skip
        assert not isinstance(result, NotWaiting)
        return result

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

        Args:
            key (str): the semaphore's key.
            waiter (str): the waiter's id.
            limit (int | None): as for :meth:`park`.
            weight (int): as for :meth:`park`: the weight the waiter parked with.
            lease (float | None): lease of the slot taken; None: the semaphore's.
            metadata (Mapping[str, Any] | None): as for :meth:`acquire`.
            room_ttl (float): as for :meth:`park`.
            delivery (str): an id of the message that started this run (each publish of a
                hand-off gets its own), recorded with the claim: if the same message is
                delivered again, its run was lost, and :class:`NotWaiting` says ``again``.

        Returns:
            Slot | Parked | NotWaiting: the slot; or :class:`Parked` when the reservation
            lapsed and the waiter is back in the room (its run should end and wait for the
            next hand-off); or :class:`NotWaiting` when nothing is reserved or parked for it:
            a duplicate copy of a run that already claimed its slot (end it quietly), or,
            with ``again``, the same delivery once more (its run was lost: run it).

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        if delivery != "":
            check.check_key(delivery, "delivery")
        result = self._park(
            key, waiter, b"", None, lease, metadata, 0, room_ttl,
            claim_only=True, deadline_ms=0, delivery=delivery, limit=limit, weight=weight,
        )  # fmt: skip
        assert not isinstance(result, RoomFull)
        return result

    def _park(
        self,
        key: str,
        waiter: str,
        payload: bytes | Callable[[], bytes],
        arrival: float | None,
        lease: float | None,
        metadata: Mapping[str, Any] | None,
        max_queued: int,
        room_ttl: float,
        *,
        claim_only: bool,
        deadline_ms: int,
        delivery: str = "",
        limit: int | None = None,
        weight: int = 1,
        group: str = "",
    ) -> Slot | Parked | RoomFull | NotWaiting:
        key = check.check_key(key)
        make = payload if callable(payload) else None
        check_waiter(waiter, b"" if make is not None else payload)
        if group != "":
            check.check_key(group, "group")
        seconds, ms, arrival_ms, max_queued, ttl_ms = park_args(
            lease, self.lease, arrival, max_queued, room_ttl
        )
        limit = self._limit(limit)
        weight = check.check_weight(weight, limit)
        info = self._metadata(metadata, limit, weight)
        keys = self._redis_keys(key)
        token = new_token()
        with acquire_span(key, limit) as record, backend_errors(key, limit):
            if make is not None and key not in self._rooms:
                sent_at = time.monotonic()
                taken = self._scripts.take(keys, limit, ms, token, info, weight)
                if isinstance(taken, Admitted):
                    record(1, OUTCOMES[Admitted])
                    return self._slot(keys, key, token, seconds, taken, sent_at, weight)
            if make is not None:
                payload = make()
                check_waiter(waiter, payload)
            assert isinstance(payload, bytes)
            sent_at = time.monotonic()
            result, handed = self._scripts.park(
                keys, limit, ms, token, info, waiter, arrival_ms, payload,
                self.handoffs.claim_ms, ttl_ms, max_queued, claim_only, deadline_ms,
                self.handoffs.grace_ms, delivery, weight, group,
            )  # fmt: skip
            assert not isinstance(result, Declined)
            record(1, OUTCOMES[type(result)])
        self._saw_room(key, not (isinstance(result, Admitted) and result.roomless))
        self.handoffs.deliver(key, handed)
        if isinstance(result, Parked):
            self.admin.index_room(key, ttl_ms)
        if isinstance(result, Admitted):
            return self._slot(keys, key, token, seconds, result, sent_at, weight)
        return result

    def _saw_room(self, key: str, room: bool) -> None:
        """Remember whether ``key`` has a waiting room, as a park just found it; a take of a
        key remembered with one is not tried (it would find the room and cost a round
        trip)."""
        if not room:
            self._rooms.discard(key)
            return
        if len(self._rooms) >= ROOMS_KEPT:
            self._rooms.clear()
        self._rooms.add(key)

    def _wait_for_slot(
        self,
        keys: Keys,
        key: str,
        token: str,
        lease: float,
        info: str,
        full: Full,
        wait: float,
        limit: int,
        weight: int = 1,
    ) -> Slot | None:
        """After ``full``, block for up to ``wait`` seconds until a release wakes this caller
        (BLPOP on the key's wake list, pushed by release.lua when the room does not take the
        freed slot), and take a slot; None when the time is up. No polling: each block ends
        at a wake-up, at the soonest lease to lapse (a crashed holder frees its slot then,
        and nobody pushes), or after :data:`MAX_BLOCK` seconds.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        ms = check.lease_ms(lease)
        give_up = time.monotonic() + wait
        try:
            while (remaining := give_up - time.monotonic()) > 0:
                with backend_errors(key, limit):
                    # Registered before asking again: a release in between pushes a wake.
                    now_ms = self._scripts.block(keys, token, math.ceil(remaining * 1000))
                    sent_at = time.monotonic()
                    reply = self._scripts.acquire(keys, limit, ms, token, info, weight)
                    if isinstance(reply, Admitted):
                        return self._slot(keys, key, token, lease, reply, sent_at, weight)
                    lapse = reply.first_lapse(now_ms)
                    self.client.blpop([keys.wake], timeout=min(remaining, lapse, MAX_BLOCK))
            return None
        finally:
            with contextlib.suppress(SemaphoreBackendError), backend_errors(key, limit):
                self.client.zrem(keys.blocked, token)
