"""Slots of several keys held together in asyncio code: :class:`AsyncSlotGroup`, returned by
:meth:`AsyncSemaphore.acquire_many
<celery_semaphore.asyncio.semaphore.AsyncSemaphore.acquire_many>`.

The asyncio twin of :class:`celery_semaphore.core.group.SlotGroup`, on the same
:class:`~celery_semaphore.core.group.GroupRecord`: one :class:`AsyncSlot` per key, all under
one token, and the loss of any is the loss of the group. Its round trips run side by side,
one per key, and each runs to its end even if another fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence

from ..core.calls import held_call
from ..core.group import GroupRecord, held_pairs
from ..core.scripts import backend_errors
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

    async def __aenter__(self) -> AsyncSlotGroup:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()


async def _each(calls: Sequence[Awaitable[bool]]) -> list[bool]:
    """Await every call to its end, even when one fails, then raise the first failure: a
    release that failed on one key must not leave the others unsent."""
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return [bool(outcome) for outcome in outcomes]
