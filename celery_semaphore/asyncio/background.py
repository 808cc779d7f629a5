"""Round trips that must finish even when the coroutine that started them is cancelled.

A cancelled ``await`` in the middle of a Redis call leaves the server's side unknown: an
acquire may have taken a slot, a release may not have run. :class:`Background` runs such
calls as tasks of their own, keeps them alive (the event loop holds tasks only weakly) and
lets :meth:`~celery_semaphore.asyncio.AsyncSemaphore.aclose` wait for the last of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Background:
    """The tasks one semaphore started and has not seen end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` as a task that is kept until it ends. A failure nobody awaits is
        dropped: coroutines run with no awaiter log their own."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def finish(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` to its end even if the caller is cancelled meanwhile: the caller
        sees the cancellation, and ``coro`` carries on as a background task."""
        return await asyncio.shield(self.spawn(coro))

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not report it a second time

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for every task still running; how many did not end
        in time (they carry on)."""
        if not self._tasks:
            return 0
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        return len(pending)
