"""The 0.1.0 spellings that moved, kept as deprecated aliases until 0.3.0 (CHANGELOG.md says
which): each warns (:class:`DeprecationWarning`, naming the new spelling) and calls it. In
0.3.0 this module goes, with the three bases it gives the public classes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .room import WaitingRoom


def moved(old: str, new: str, target: Callable[[Any], Callable[..., Any]]) -> Callable[..., Any]:
    """A deprecated alias for a class body: it warns (:class:`DeprecationWarning`, naming
    ``new``) and calls ``target(self)`` with its arguments, whose answer (a coroutine, for
    an asyncio method) it returns. Deprecated in 0.2.0; the aliases go in 0.3.0.

    Args:
        old (str): the deprecated spelling, ``Class.method``.
        new (str): the spelling to use instead.
        target (Callable[[Any], Callable[..., Any]]): the new method, from the instance.

    Returns:
        Callable[..., Any]: the alias, whose ``__deprecated__`` names ``new``.
    """

    def alias(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"{old} is deprecated and will be removed in 0.3.0; use {new}",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return target(self)(*args, **kwargs)

    alias.__doc__ = f"Deprecated since 0.2.0, removed in 0.3.0: use ``{new}``."
    alias.__deprecated__ = new  # type: ignore[attr-defined]
    return alias


def _room_of(admin: Any) -> WaitingRoom:
    from .room import WaitingRoom  # room.py imports admin.py, which imports this module

    return WaitingRoom(admin.client, admin.prefix, admin.handoffs)


class SemaphoreMoved:
    """The deprecated spellings of :class:`~celery_semaphore.core.semaphore.Semaphore`."""

    force_release = moved("Semaphore.force_release", "sem.admin.force_release",
                          lambda sem: sem.admin.force_release)  # fmt: skip
    force_release_all = moved("Semaphore.force_release_all", "sem.admin.force_release_all",
                              lambda sem: sem.admin.force_release_all)  # fmt: skip
    holders = moved("Semaphore.holders", "sem.admin.holders", lambda sem: sem.admin.holders)
    set_limit = moved("Semaphore.set_limit", "sem.admin.set_limit", lambda sem: sem.admin.set_limit)
    park = moved("Semaphore.park", "sem.room.park", lambda sem: sem.room.park)
    claim = moved("Semaphore.claim", "sem.room.claim", lambda sem: sem.room.claim)
    park_many = moved("Semaphore.park_many", "sem.room.park_many", lambda sem: sem.room.park_many)
    claim_many = moved("Semaphore.claim_many", "sem.room.claim_many",
                       lambda sem: sem.room.claim_many)  # fmt: skip


class AsyncSemaphoreMoved:
    """The deprecated spellings of :class:`~celery_semaphore.asyncio.AsyncSemaphore`."""

    force_release_all = moved("AsyncSemaphore.force_release_all", "sem.admin.force_release_all",
                              lambda sem: sem.admin.force_release_all)  # fmt: skip
    holders = moved("AsyncSemaphore.holders", "sem.admin.holders", lambda sem: sem.admin.holders)
    set_limit = moved("AsyncSemaphore.set_limit", "sem.admin.set_limit",
                      lambda sem: sem.admin.set_limit)  # fmt: skip
    live_limit = moved("AsyncSemaphore.live_limit", "sem.admin.live_limit",
                       lambda sem: sem.admin.live_limit)  # fmt: skip


class AdminMoved:
    """The deprecated spellings of :class:`~celery_semaphore.core.admin.SemaphoreAdmin`."""

    room = moved("SemaphoreAdmin.room", "sem.room.waiters", lambda a: _room_of(a).waiters)
    room_head = moved("SemaphoreAdmin.room_head", "sem.room.head", lambda a: _room_of(a).head)
    sweep = moved("SemaphoreAdmin.sweep", "sem.room.sweep", lambda a: _room_of(a).sweep)
    cancel = moved("SemaphoreAdmin.cancel", "sem.room.cancel", lambda a: _room_of(a).cancel)
