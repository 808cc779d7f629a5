"""Slots of several keys held together in asyncio code: :class:`AsyncSlotGroup`, returned by
:meth:`AsyncSemaphore.acquire_many
<celery_semaphore.asyncio.semaphore.AsyncSemaphore.acquire_many>`, which takes all of them
in one script call or none (:func:`take_group`).

The asyncio twin of :mod:`celery_semaphore.core.group`: the same
:class:`~celery_semaphore.core.group.GroupRecord` (one :class:`AsyncSlot` per key, all under
one token, and the loss of any is the loss of the group), the arguments checked and the call
planned by the same :meth:`~celery_semaphore.core.options.Planner.many` (a cluster misfit is
refused by the same :func:`~celery_semaphore.core.names.many_redis_keys`), and the keys taken
by the same acquire_many.lua. What is asyncio's own: the round trips run side by side, one
per key, and each runs to its end even if another fails; an acquire is safe to cancel (see
:meth:`Acquirer.taking <celery_semaphore.asyncio.acquiring.Acquirer.taking>`: a cancelled
acquire gives back every key it took); and the loop's renewer renews the slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Sequence

from ..core.calls import held_call
from ..core.feedback import BackOff
from ..core.group import GroupRecord, held_pairs
from ..core.options import ManyPlan
from ..core.scripts import backend_errors
from ..core.tracing import acquire_span
from .acquiring import Acquirer
from .slot import AsyncSlot


class AsyncSlotGroup(GroupRecord[AsyncSlot]):
    """The slots of several keys, taken together by
    :meth:`AsyncSemaphore.acquire_many
    <celery_semaphore.asyncio.semaphore.AsyncSemaphore.acquire_many>`.

    Attributes:
        slots (tuple[AsyncSlot, ...]): one slot per key, in the order the keys were given.
        key (str): the keys, joined with ``+`` (for messages).
        lost (asyncio.Event): set the moment any of the slots is known to be lost.

    It offers what a body needs of a slot (``lost``, ``when_lost``, ``lease``, ``weight``,
    ``token``, ``extend``, ``is_held``, ``release``); ``limit`` is the first key's.
    ``async with group:`` releases every slot on exit. A group from ``acquire_many`` is not
    renewed in the background: use :meth:`AsyncSemaphore.hold_many
    <celery_semaphore.asyncio.semaphore.AsyncSemaphore.hold_many>` for that, or ``extend`` it.
    """

    lost: asyncio.Event
    _new_lost = asyncio.Event
    _new_lock = contextlib.nullcontext  # one event loop, no threads: nothing to lock

    async def extend(self, lease: float | None = None) -> bool:
        """Extend every slot, one round trip each, side by side.

        Args:
            lease (float | None): new lease in seconds; None keeps each slot's current one.

        Returns:
            bool: True when every slot was still held and is extended; False when any is
            gone (then :attr:`lost` is set).

        Raises:
            SemaphoreValidationError: ``lease`` is not a positive finite number of seconds.
            SemaphoreBackendError: a round trip failed (the others were still waited for).
        """
        return all(await _each([slot.extend(lease) for slot in self.slots]))

    async def is_held(self) -> bool:
        """Ask the store whether every slot of the group is still ours, in one read-only
        round trip for all of them, as :meth:`SlotGroup.is_held
        <celery_semaphore.core.group.SlotGroup.is_held>` does.

        Returns:
            bool: True while every slot is held; False once any was released, lapsed or
            taken away. Nothing is renewed, and :attr:`lost` is left as it is.

        Raises:
            SemaphoreBackendError: the round trip failed.
        """
        scripts = self.slots[0]._renewal()[0]
        with backend_errors(self.key, self.limit):
            answers: list[bool] = await scripts.run(held_call(held_pairs(self.slots)))
        return all(answers)

    async def release(self) -> bool:
        """Give every slot back, one round trip each, side by side (each hands off to its own
        key's waiting room). A caller cancelled meanwhile does not stop them.

        Returns:
            bool: True when every slot was held up to now; False when any had lapsed or been
            taken away (then :attr:`lost` is set).

        Raises:
            SemaphoreBackendError: a round trip failed; that slot lapses within its lease,
                and a later call tries it again (the others are released all the same).
        """
        return all(await _each([slot.release() for slot in self.slots]))

    async def back_off(self, retry_after: object = None, key: str | None = None) -> float:
        """Give every slot back, the one of ``key`` (None: the first key) with a back-off;
        see :meth:`SlotGroup.back_off <celery_semaphore.core.group.SlotGroup.back_off>`."""
        ends = await self._backing_off(key).back_off(retry_after)
        await self.release()
        return ends

    async def __aenter__(self) -> AsyncSlotGroup:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, BackOff):
            await self.back_off(exc.retry_after, exc.key)
        else:
            await self.release()


async def _each(calls: Sequence[Awaitable[bool]]) -> list[bool]:
    """Await every call to its end, even when one fails, then raise the first failure: a
    release that failed on one key must not leave the others unsent."""
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return [bool(outcome) for outcome in outcomes]


async def take_group(acquirer: Acquirer, plan: ManyPlan) -> AsyncSlotGroup | None:
    """Take a slot of every key of ``plan`` in one script call, or none, attempt after
    attempt as ``plan`` says (see :meth:`AsyncSemaphore.acquire_many
    <celery_semaphore.asyncio.AsyncSemaphore.acquire_many>`): the group, or None when every
    attempt found some key without room.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    held = list(zip(plan.keys, plan.names, strict=True))
    with acquire_span(plan.label, plan.limit, plan.names) as record:
        for attempt in range(plan.attempts):
            if attempt:
                await asyncio.sleep(plan.delay)
            sent_at = time.monotonic()
            reply = await acquirer.taking(plan.call, plan.label, plan.token, held)
            if not isinstance(reply, list):
                continue
            if time.monotonic() - sent_at < plan.seconds:
                record(attempt + 1, "acquired")
                return AsyncSlotGroup(
                    [acquirer.slot(k, key, plan.token, plan.seconds, admitted, sent_at, weight)
                     for k, key, admitted, weight in plan.members(reply)]
                )  # fmt: skip
            # Answered after a whole lease: the slots cannot be trusted to be ours.
            await acquirer.background.finish(acquirer.give_back_all(held, plan.token))
        record(plan.attempts, "full")
    return None
