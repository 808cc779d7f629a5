"""Slots of several semaphores held together: :class:`SlotGroup`, returned by
:meth:`Semaphore.acquire_many`, which takes all of them in one script call or none.

A run bounded at more than one level (the provider's 20 calls in flight, and 2 per tenant)
holds one slot of each key, all under one token. The renewer renews them with the process's
other slots (one round trip per tick per hash slot, so one for all of a group on a cluster,
whose keys share a hash slot), and the loss of any is the loss of the group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from ..errors import SemaphoreLeaseLostError
from . import validation as check
from .lazy_event import LazyEvent
from .options import many_args, many_plan
from .parking import OUTCOMES, WaitingRoom, check_waiter, park_args
from .process import new_token
from .room import DEFAULT_ROOM_TTL
from .scripts import Admitted, NotWaiting, Parked, RoomFull, backend_errors
from .slot import Slot
from .tracing import acquire_span


class _Flag(Protocol):
    def is_set(self) -> bool: ...


class Member(Protocol):
    """What a group needs of each of its slots, a :class:`Slot` or an asyncio
    :class:`~celery_semaphore.asyncio.slot.AsyncSlot`."""

    key: str
    limit: int
    token: str
    lease: float
    weight: int

    @property
    def lost(self) -> _Flag: ...

    def check_deadline(self) -> None: ...

    def lease_lost_error(self) -> SemaphoreLeaseLostError: ...


M = TypeVar("M", bound=Member)


class GroupRecord(Generic[M]):
    """What a group of slots taken together is, sync or asyncio: its slots, keys and token,
    and how its loss is judged and reported. :class:`SlotGroup` and
    :class:`~celery_semaphore.asyncio.group.AsyncSlotGroup` add the ``lost`` event and the
    round trips.

    Args:
        slots (Sequence[Slot | AsyncSlot]): one slot per key, in the order the keys were
            given, all under one token.
    """

    lost: _Flag

    def __init__(self, slots: Sequence[M]) -> None:
        self.slots = tuple(slots)
        self.key = "+".join(s.key for s in self.slots)

    def __repr__(self) -> str:
        state = " lost" if self.lost.is_set() else ""
        return f"<{type(self).__name__} {self.keys!r}{state}>"

    @property
    def keys(self) -> list[str]:
        """The keys, in the order they were given."""
        return [s.key for s in self.slots]

    @property
    def token(self) -> str:
        """The token every slot of the group shares."""
        return self.slots[0].token

    @property
    def limit(self) -> int:
        """The first key's limit (see each slot's own ``limit``)."""
        return self.slots[0].limit

    @property
    def lease(self) -> float:
        """Seconds each slot lives without an extend."""
        return self.slots[0].lease

    @property
    def weight(self) -> int:
        """Units of each key's limit the group takes (the first key's, when they differ)."""
        return self.slots[0].weight

    def check_deadline(self) -> None:
        """Mark lost each slot whose deadline passed without a renewal."""
        for slot in self.slots:
            slot.check_deadline()

    def lease_lost_error(self) -> SemaphoreLeaseLostError:
        """The error that reports the group's loss: the first lost slot's."""
        for slot in self.slots:
            if slot.lost.is_set():
                return slot.lease_lost_error()
        return self.slots[0].lease_lost_error()


class SlotGroup(GroupRecord[Slot]):
    """The slots of several keys, taken together by :meth:`Semaphore.acquire_many`.

    Attributes:
        slots (tuple[Slot, ...]): one slot per key, in the order the keys were given.
        key (str): the keys, joined with ``+`` (for messages).
        lost (threading.Event): set the moment any of the slots is known to be lost.

    It offers what a body needs of a slot (``lost``, ``lease``, ``weight``, ``token``,
    ``extend``, ``release``); ``limit`` is the first key's. A context manager releases every
    slot on exit.
    """

    lost: threading.Event

    def __init__(self, slots: Sequence[Slot]) -> None:
        super().__init__(slots)
        self.lost = LazyEvent()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[SlotGroup], object]] = []
        for slot in self.slots:
            slot.when_lost(self._member_lost)

    def _member_lost(self, _: Slot) -> None:
        with self._lock:
            if self.lost.is_set():
                return
            self.lost.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def when_lost(self, callback: Callable[[SlotGroup], object]) -> None:
        """Call ``callback(group)`` once, the moment any of its slots is known to be lost
        (at once if one already is); see :meth:`Slot.when_lost`."""
        with self._lock:
            if not self.lost.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def extend(self, lease: float | None = None) -> bool:
        """Extend every slot (one round trip each): True when all were still held.

        Raises:
            SemaphoreValidationError: ``lease`` is not a positive finite number of seconds.
            SemaphoreBackendError: a round trip failed.
        """
        return all([slot.extend(lease) for slot in self.slots])

    def release(self) -> bool:
        """Give every slot back (one round trip each; each hands off to its own key's
        waiting room): True when every one was held up to now.

        Raises:
            SemaphoreBackendError: a round trip failed; the slots not released lapse with
                their lease.
        """
        return all([slot.release() for slot in self.slots])

    def __enter__(self) -> SlotGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class ManyKeys(WaitingRoom):
    """:meth:`acquire_many`, :meth:`park_many` and :meth:`claim_many`, methods of
    :class:`~celery_semaphore.core.semaphore.Semaphore` (its attributes and helpers are
    declared on :class:`~celery_semaphore.core.parking.WaitingRoom`)."""

    def acquire_many(
        self,
        keys: Sequence[tuple[str, int] | tuple[str, int, int]],
        *,
        lease: float | None = None,
        retries: int = 0,
        retry_delay: float = 0.1,
        metadata: Mapping[str, Any] | None = None,
    ) -> SlotGroup | None:
        """Take a slot of every key, all in one script call or none: a run bounded at
        several levels at once (the provider's limit and a tenant's) never holds one slot
        while it waits for another.

        Args:
            keys (Sequence[tuple[str, int] | tuple[str, int, int]]): ``(key, limit)`` or
                ``(key, limit, weight)`` for each key, at least one, no key twice. On Redis
                Cluster they must share a hash tag (``"{llm}openai"``,
                ``"{llm}tenant:acme"``). A live limit set on a key wins over its limit.
            lease (float | None): as for :meth:`Semaphore.acquire`.
            retries (int): as for :meth:`Semaphore.acquire`.
            retry_delay (float): as for :meth:`Semaphore.acquire`.
            metadata (Mapping[str, Any] | None): as for :meth:`Semaphore.acquire`.

        Returns:
            SlotGroup | None: the slots, which the caller must release (one round trip per
            key); None if every attempt found some key without room.

        Raises:
            SemaphoreValidationError: an argument is invalid, a key is given twice, or on a
                cluster the keys share no hash slot (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        plan = many_plan(keys, lease, self.lease, retries, retry_delay, metadata,
                         self._metadata, self.admin.keys_of_many)  # fmt: skip
        with acquire_span(plan.label, plan.limit, plan.names) as record:
            for attempt in range(plan.attempts):
                if attempt:
                    time.sleep(plan.delay)
                sent_at = time.monotonic()
                with backend_errors(plan.label, plan.limit):
                    reply = self._scripts.acquire_many(plan.groups, plan.ms, plan.token, plan.info)
                if isinstance(reply, list):
                    group = SlotGroup(
                        [self._slot(k, key, plan.token, plan.seconds, admitted, sent_at, weight)
                         for k, key, admitted, weight in plan.members(reply)]
                    )  # fmt: skip
                    if time.monotonic() - sent_at < plan.seconds:
                        record(attempt + 1, "acquired")
                        return group
                    group.release()  # answered after a whole lease: not to be trusted
            record(plan.attempts, "full")
        return None

    def park_many(
        self,
        keys: Sequence[tuple[str, int] | tuple[str, int, int]],
        waiter: str,
        payload: bytes,
        *,
        arrival: float | None = None,
        lease: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        max_queued: int = 0,
        room_ttl: float = DEFAULT_ROOM_TTL,
        deadline: float | None = None,
    ) -> SlotGroup | Parked | RoomFull:
        """Take a slot of every key in arrival order, all in one script call, or park
        ``waiter`` in the waiting room of the first key that cannot take it yet (too full,
        or older waiters parked there). A hand-off from that room starts it again, and its
        run then calls :meth:`claim_many`: it takes every key, or waits in the next key's
        room, handing on the slot reserved for it. It waits in one room at a time, and never
        holds one key's slot while it waits for another's.

        Args:
            keys (Sequence[tuple[str, int] | tuple[str, int, int]]): as for
                :meth:`acquire_many`.
            waiter (str): as for :meth:`Semaphore.park`.
            payload (bytes): as for :meth:`Semaphore.park`.
            arrival (float | None): as for :meth:`Semaphore.park`.
            lease (float | None): as for :meth:`Semaphore.park`.
            metadata (Mapping[str, Any] | None): as for :meth:`Semaphore.park`.
            max_queued (int): as for :meth:`Semaphore.park`, counting the room it would
                wait in.
            room_ttl (float): as for :meth:`Semaphore.park`.
            deadline (float | None): as for :meth:`Semaphore.park`.

        Returns:
            SlotGroup | Parked | RoomFull: the slots; or where the waiter stands
            (``Parked.index`` is the 1-based key whose room it is in); or a refusal, that
            room being full.

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        deadline_ms = 0
        if deadline is not None:
            deadline_ms = round(check.check_epoch(deadline, "deadline") * 1000)
        result = self._park_many(
            keys, waiter, payload, arrival, lease, metadata, max_queued, room_ttl,
            claim_only=False, deadline_ms=deadline_ms,
        )  # fmt: skip
        assert not isinstance(result, NotWaiting)
        return result

    def claim_many(
        self,
        keys: Sequence[tuple[str, int] | tuple[str, int, int]],
        waiter: str,
        *,
        lease: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        room_ttl: float = DEFAULT_ROOM_TTL,
        delivery: str = "",
    ) -> SlotGroup | Parked | NotWaiting:
        """Take every key with the slot a hand-off reserved for ``waiter`` on one of them,
        or wait in the room of the first that cannot take it yet; see :meth:`park_many`
        and, for the answers, :meth:`Semaphore.claim`.

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent to Redis).
            SemaphoreBackendError: Redis failed.
        """
        if delivery != "":
            check.check_key(delivery, "delivery")
        result = self._park_many(
            keys, waiter, b"", None, lease, metadata, 0, room_ttl,
            claim_only=True, deadline_ms=0, delivery=delivery,
        )  # fmt: skip
        assert not isinstance(result, RoomFull)
        return result

    def _park_many(
        self,
        keys: Sequence[tuple[str, int] | tuple[str, int, int]],
        waiter: str,
        payload: bytes,
        arrival: float | None,
        lease: float | None,
        metadata: Mapping[str, Any] | None,
        max_queued: int,
        room_ttl: float,
        *,
        claim_only: bool,
        deadline_ms: int,
        delivery: str = "",
    ) -> SlotGroup | Parked | RoomFull | NotWaiting:
        specs = many_args(keys)
        check_waiter(waiter, payload)
        seconds, ms, arrival_ms, max_queued, ttl_ms = park_args(
            lease, self.lease, arrival, max_queued, room_ttl
        )
        info = self._metadata(metadata, specs[0][1], specs[0][2])
        all_keys = self.admin.keys_of_many([key for key, _, _ in specs])
        groups = [(k, limit, weight) for k, (_, limit, weight) in zip(all_keys, specs, strict=True)]
        token = new_token()
        label = "+".join(key for key, _, _ in specs)
        sent_at = time.monotonic()
        with (
            acquire_span(label, specs[0][1], [key for key, _, _ in specs]) as record,
            backend_errors(label, specs[0][1]),
        ):
            result, handed = self._scripts.park_many(
                groups, ms, token, info, waiter, arrival_ms, payload, self.handoffs.claim_ms,
                ttl_ms, max_queued, claim_only, deadline_ms, delivery,
            )  # fmt: skip
            record(1, OUTCOMES[type(result)])
        self.handoffs.deliver(label, handed)
        if isinstance(result, Parked):
            self.admin.index_room(specs[result.index - 1][0], ttl_ms)
        if isinstance(result, Admitted):
            return SlotGroup(
                [self._slot(k, key, token, seconds, Admitted(result.expires_at_ms,
                            result.now_ms, limit), sent_at, weight)
                 for k, (key, limit, weight) in zip(all_keys, specs, strict=True)]
            )  # fmt: skip
        return result
