"""The round trips behind ``AsyncSemaphore.acquire``, and the slots it hands out.

Cancellation is what makes them more than a copy of the sync ones. A cancelled ``await`` in
the middle of an acquire leaves the server's side unknown, so each attempt runs as a task of
its own (:meth:`Acquirer.take`): a cancelled caller stops waiting for it, and once its answer
is in, whatever slot it took is given back. The wait for a release (:meth:`Acquirer.wait`)
follows the sync protocol: register as blocked (block.lua), ask again, then BLPOP the key's
wake list, which release.lua pushes to when the waiting room does not take the freed slot.
Sync and asyncio callers block on one list, so a release by either wakes either.

Such round trips must finish even when the coroutine that started them is cancelled: an
acquire may have taken a slot, a release may not have run. :class:`Background` runs them as
tasks of their own, keeps them alive (the event loop holds tasks only weakly) and lets
:meth:`~celery_semaphore.asyncio.AsyncSemaphore.aclose` wait for the last of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from ..core.calls import Call, acquire_call, block_call, release_call
from ..core.handoff import HandoffRoute
from ..core.names import Keys
from ..core.options import AcquirePlan
from ..core.replies import Admitted, Full
from ..core.scripts import AsyncScripts, backend_errors
from ..core.semaphore import MAX_BLOCK
from ..errors import SemaphoreBackendError
from .slot import AsyncSlot, deliver

logger = logging.getLogger(__name__)

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


class Acquirer:
    """Takes, waits for and gives back the slots of one semaphore, and keeps those it
    handed out until they are released (for ``aclose``).

    Args:
        scripts (AsyncScripts): the scripts, on the semaphore's client.
        limit (int): the semaphore's limit.
        handoffs (HandoffRoute): where the hand-offs of a give-back go.
    """

    def __init__(self, scripts: AsyncScripts, limit: int, handoffs: HandoffRoute) -> None:
        self.scripts = scripts
        self.limit = limit
        self.handoffs = handoffs
        # (token, key) -> slot not yet released; the slots of a group share one token.
        self.held: dict[tuple[str, str], AsyncSlot] = {}
        self.background = Background()
        # How many times aclose() has ended the waits: a caller that saw it move while it
        # waited was stopped by a close, not by its time running out.
        self.closes = 0
        self._stops: set[asyncio.Event] = set()

    def stop_waits(self) -> None:
        """End every :meth:`wait` under way, as if its time were up (``aclose`` does this);
        waits begun afterwards run as usual."""
        self.closes += 1
        for stop in self._stops:
            stop.set()

    async def run(self, key: str, call: Call[T]) -> T:
        """Send ``call``; a redis-py error becomes :class:`SemaphoreBackendError`."""
        with backend_errors(key, self.limit):
            return await self.scripts.run(call)

    async def take(self, plan: AcquirePlan) -> Admitted | Full:
        """One acquire round trip of ``plan`` (``weight`` units under ``limit`` and the start
        rates ``rated``) that a cancelled caller cannot leak: the call runs on as a task of
        its own, and whatever slot it took is given back once its answer is in.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        return await self.taking(
            acquire_call(plan.keys, plan.limit, plan.ms, plan.token, plan.weight, plan.rated),
            plan.key, plan.token, [(plan.keys, plan.key)],
        )  # fmt: skip

    async def taking(
        self, call: Call[T], label: str, token: str, held: Sequence[tuple[Keys, str]]
    ) -> T:
        """Send ``call``, an acquire that may take a slot of each ``(keys, key)`` of ``held``
        under ``token``, so that a cancelled caller cannot leak them: the call runs on as a
        task of its own, and whatever it took is given back once its answer is in.

        Raises:
            SemaphoreBackendError: Redis failed (``label`` names the key or keys).
        """
        attempt = self.background.spawn(self.run(label, call))
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            self.background.spawn(self._give_back_after(attempt, held, token))
            raise

    async def _give_back_after(
        self, attempt: asyncio.Task[Any], held: Sequence[tuple[Keys, str]], token: str
    ) -> None:
        try:
            # acquire.lua admits with an Admitted, acquire_many.lua with a list of them.
            taken = isinstance(await attempt, (Admitted, list))
        except SemaphoreBackendError:
            taken = True  # no answer: the script may have run, and a release costs nothing
        if taken:
            await self.give_back_all(held, token)

    async def give_back_all(self, held: Sequence[tuple[Keys, str]], token: str) -> None:
        """Release ``token`` from each ``(keys, key)`` of ``held`` at once (see
        :meth:`give_back`). Never raises."""
        await asyncio.gather(*(self.give_back(keys, key, token) for keys, key in held))

    async def give_back(self, keys: Keys, key: str, token: str) -> None:
        """Release ``token``, a slot nobody holds. Never raises: a failure is logged, and
        the slot lapses with its lease."""
        try:
            call = release_call(keys, token, self.handoffs.release_claim_ms, None)
            released = await self.run(key, call)
            await deliver(self.handoffs, key, released.handed, self.scripts)
        except SemaphoreBackendError:
            logger.warning("could not give back a slot of %r that nobody holds; it lapses", key)

    def slot(
        self,
        keys: Keys,
        key: str,
        token: str,
        lease: float,
        admitted: Admitted,
        sent_at: float,
        weight: int = 1,
    ) -> AsyncSlot:
        """The slot ``admitted`` describes, kept in :attr:`held` until it is released."""
        slot = AsyncSlot(
            self.scripts, keys, key, self.limit, token, float(lease), admitted, sent_at,
            self.handoffs, self._forget, weight,
        )  # fmt: skip
        self.held[token, key] = slot
        return slot

    def _forget(self, slot: AsyncSlot) -> None:
        self.held.pop((slot._member, slot.key), None)

    async def wait(self, plan: AcquirePlan) -> AsyncSlot | None:
        """After ``plan``'s acquire found the key full, wait up to ``plan.wait`` seconds
        until a release wakes this caller, and take the slot ``plan`` asks for; None when
        the time is up. Each block ends at a wake-up, at the soonest
        lease to lapse (a crashed holder frees its slot then, and nobody pushes), or after
        :data:`~celery_semaphore.core.semaphore.MAX_BLOCK` seconds.

        Cancelled, it leaves no slot held (see :meth:`take`) and no registration behind:
        the BLPOP is dropped with its connection, and the registration is removed by a
        round trip that runs to its end.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        keys, key, token = plan.keys, plan.key, plan.token
        give_up = time.monotonic() + plan.wait
        slot = None
        stop = asyncio.Event()
        self._stops.add(stop)
        try:
            while (remaining := give_up - time.monotonic()) > 0 and not stop.is_set():
                # Registered before asking again: a release in between pushes a wake.
                now_ms = await self.run(key, block_call(keys, token, math.ceil(remaining * 1000)))
                sent_at = time.monotonic()
                reply = await self.take(plan)
                if isinstance(reply, Admitted):
                    slot = self.slot(keys, key, token, plan.seconds, reply, sent_at, plan.weight)
                    return slot
                lapse = reply.first_lapse(now_ms, min(remaining, MAX_BLOCK))
                if reply.start_ms:  # a rate's instant: slept out here (see Semaphore._wait)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), lapse)
                else:
                    await self._block(keys, key, lapse, stop)
            return None
        finally:
            self._stops.discard(stop)
            try:
                await self.background.finish(self._unblock(keys, key, token))
            except asyncio.CancelledError:
                if slot is not None:  # won, then cancelled: nobody will hold it
                    self.background.spawn(slot.release())
                raise

    async def _block(self, keys: Keys, key: str, timeout: float, stop: asyncio.Event) -> None:
        """BLPOP the key's wake list for up to ``timeout`` seconds, or until ``stop`` is set:
        a close must not wait for the pop (up to :data:`MAX_BLOCK` s) to end on its own.
        A pop cut short drops its connection, as a cancelled one does."""
        pop = asyncio.ensure_future(self.scripts.client.blpop([keys.wake], timeout=timeout))
        halt = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({pop, halt}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            halt.cancel()
            pop.cancel()
        if pop.done() and not pop.cancelled():
            with backend_errors(key, self.limit):
                pop.result()

    async def _unblock(self, keys: Keys, key: str, token: str) -> None:
        with contextlib.suppress(SemaphoreBackendError), backend_errors(key, self.limit):
            await self.scripts.client.zrem(keys.blocked, token)
