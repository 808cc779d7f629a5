"""Slots of several semaphores held together: :class:`SlotGroup`, returned by
:meth:`Semaphore.acquire_many`, which takes all of them in one script call or none
(:func:`take_group`).

A run bounded at more than one level (the provider's 20 calls in flight, and 2 per tenant)
holds one slot of each key, all under one token. The renewer renews them with the process's
other slots (one round trip per tick per hash slot, so one for all of a group on a cluster,
whose keys share a hash slot), and the loss of any is the loss of the group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from ..errors import (
    Refusal,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from .calls import held_call
from .feedback import BackOff
from .lazy_event import LazyEvent
from .lease import LeaseRecord, LossWatch
from .names import Keys
from .options import ManyPlan, many_args
from .replies import Admitted
from .scripts import Scripts, backend_errors
from .slot import Slot
from .tracing import acquire_span

M = TypeVar("M", bound=LeaseRecord[Any])  # a Slot, or an asyncio AsyncSlot


class GroupRecord(LossWatch, Generic[M]):
    """What a group of slots taken together is, sync or asyncio: its slots, keys and token,
    and how its loss is judged and reported. :class:`SlotGroup` and
    :class:`~celery_semaphore.asyncio.group.AsyncSlotGroup` add the round trips.

    Args:
        slots (Sequence[Slot | AsyncSlot]): one slot per key, in the order the keys were
            given, all under one token.
    """

    def __init__(self, slots: Sequence[M]) -> None:
        super().__init__()
        self.slots = tuple(slots)
        self.key = "+".join(s.key for s in self.slots)
        for slot in self.slots:
            slot.when_lost(lambda _: self._mark_lost())

    def _backing_off(self, key: str | None) -> M:
        """The slot a back-off of ``key`` (None: the first key) is about.

        Raises:
            SemaphoreValidationError: ``key`` is not one of the group's.
        """
        for slot in self.slots:
            if key is None or slot.key == key:
                return slot
        raise SemaphoreValidationError(f"back-off names key {key!r}, not one of {self.key!r}")

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

    def _check_deadline(self) -> None:
        """Mark lost each slot whose deadline passed without a renewal."""
        for slot in self.slots:
            slot._check_deadline()

    def lease_lost_error(self) -> SemaphoreLeaseLostError:
        """The error that reports the group's loss: the first lost slot's."""
        for slot in self.slots:
            if slot.lost.is_set():
                return slot.lease_lost_error()
        return self.slots[0].lease_lost_error()


def held_pairs(slots: Sequence[LeaseRecord[Any]]) -> list[tuple[Keys, str]]:
    """What :func:`~.calls.held_call` asks about each of ``slots``: its keys and member."""
    return [(keys, member) for _, keys, member, _ in (slot._renewal() for slot in slots)]


class SlotGroup(GroupRecord[Slot]):
    """The slots of several keys, taken together by :meth:`Semaphore.acquire_many`.

    Attributes:
        slots (tuple[Slot, ...]): one slot per key, in the order the keys were given.
        key (str): the keys, joined with ``+`` (for messages).
        lost (threading.Event): set the moment any of the slots is known to be lost.

    It offers what a body needs of a slot (``lost``, ``lease``, ``weight``, ``token``,
    ``extend``, ``is_held``, ``release``); ``limit`` is the first key's. A context manager
    releases every slot on exit.
    """

    lost: threading.Event
    _new_lost = LazyEvent
    # A loss may be found in the renewer's thread while the body's asks when_lost.
    _new_lock = threading.Lock

    def extend(self, lease: float | None = None) -> bool:
        """Extend every slot (one round trip each): True when all were still held.

        Raises:
            SemaphoreValidationError: ``lease`` is not a positive finite number of seconds.
            SemaphoreBackendError: a round trip failed.
        """
        return all([slot.extend(lease) for slot in self.slots])

    def is_held(self) -> bool:
        """Ask the store whether every slot of the group is still ours (one read-only round
        trip for all of them: their keys share a hash slot); see :meth:`Slot.is_held`.

        Returns:
            bool: True while every slot is held; False once any was released, lapsed or
            taken away. Nothing is renewed, and :attr:`lost` is left as it is.

        Raises:
            SemaphoreBackendError: the round trip failed.
        """
        scripts = self.slots[0]._renewal()[0]
        with backend_errors(self.key, self.limit):
            answers: list[bool] = scripts.run(held_call(held_pairs(self.slots)))
        return all(answers)

    def release(self) -> bool:
        """Give every slot back (one round trip each; each hands off to its own key's
        waiting room): True when every one was held up to now.

        Raises:
            SemaphoreBackendError: a round trip failed; the slots not released lapse with
                their lease.
        """
        return all([slot.release() for slot in self.slots])

    def back_off(self, retry_after: object = None, key: str | None = None) -> float:
        """Give every slot back, the one of ``key`` (None: the first key) with a back-off
        (see :meth:`Slot.back_off`); returns when that key's cool-down ends (epoch seconds).

        Raises:
            SemaphoreValidationError: ``key`` is not one of the group's, or ``retry_after``
                is unreadable (nothing is sent).
            SemaphoreBackendError: a round trip failed.
        """
        ends = self._backing_off(key).back_off(retry_after)
        self.release()
        return ends

    def __enter__(self) -> SlotGroup:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, BackOff):
            self.back_off(exc.retry_after, exc.key)
        else:
            self.release()


def take_group(
    scripts: Scripts, plan: ManyPlan, slot: Callable[[Keys, str, str, float, Admitted, float, int],
                                                     Slot],
) -> SlotGroup | None:  # fmt: skip
    """Take a slot of every key of ``plan`` in one script call, or none, attempt after
    attempt as ``plan`` says: the group, made of ``slot(keys, key, token, lease, admitted,
    sent_at, weight)`` for each key, or None when every attempt found some key without room.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    with acquire_span(plan.label, plan.limit, plan.names) as record:
        for attempt in range(plan.attempts):
            if attempt:
                time.sleep(plan.delay)
            sent_at = time.monotonic()
            with backend_errors(plan.label, plan.limit):
                reply = scripts.run(plan.call)
            if isinstance(reply, list):
                group = SlotGroup(
                    [slot(k, key, plan.token, plan.seconds, admitted, sent_at, weight)
                     for k, key, admitted, weight in plan.members(reply)]
                )  # fmt: skip
                if time.monotonic() - sent_at < plan.seconds:
                    record(attempt + 1, "acquired")
                    return group
                group.release()  # answered after a whole lease: not to be trusted
        record(plan.attempts, "full")
    return None


def group_refused(keys: object) -> SemaphoreNotAcquiredError:
    """The error of a hold of several ``keys`` (``(key, limit[, weight])`` each, already
    checked) that found some key without room."""
    specs = many_args(keys)
    label = "+".join(key for key, _, _ in specs)
    return SemaphoreNotAcquiredError(
        f"semaphore {label!r}: not every key had room, so none was taken", label, specs[0][1],
        Refusal.FULL,
    )  # fmt: skip
