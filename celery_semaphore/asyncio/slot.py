"""A held slot in asyncio code: the lease a holder keeps alive, gives back, or learns it lost.

:class:`AsyncSlot` is what :meth:`~celery_semaphore.asyncio.AsyncSemaphore.acquire` returns.
It is the asyncio twin of :class:`celery_semaphore.core.slot.Slot`, with the same lease
bookkeeping, the same scripts and the same verdicts; ``lost`` is an :class:`asyncio.Event`,
and a slot belongs to the event loop it was acquired in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from ..core.calls import held_call, release_call
from ..core.feedback import BackOff
from ..core.handoff import HandoffRoute, delivery
from ..core.lease import LeaseRecord
from ..core.names import Keys
from ..core.recovery import Lost, lost_call
from ..core.replies import Admitted, Handoff, SweepDue
from ..core.scripts import REDIS_ERRORS, AsyncScripts, backend_error, backend_errors


async def deliver(
    handoffs: HandoffRoute, key: str, handed: Sequence[Handoff], scripts: AsyncScripts
) -> None:
    """:meth:`HandoffRoute.deliver` from asyncio code: the same steps
    (:func:`~celery_semaphore.core.handoff.delivery`) on the asyncio client, and the
    publisher (Celery's, say, which does blocking I/O) called in a worker thread, so that it
    does not stall the event loop. Never raises."""
    steps = delivery(key, handed, handoffs.claim_ms, handoffs.publisher is not None)
    answer: list[Handoff] | Exception | None = None
    while True:
        try:
            step = steps.send(answer)
        except StopIteration as done:
            if done.value:
                await asyncio.to_thread(handoffs.publish, key, done.value)
            return
        try:
            if isinstance(step, SweepDue):
                await scripts.client.zadd(step.index, {step.key: step.due_ms}, xx=True, lt=True)
                answer = None
            else:
                answer = await scripts.run(step)
        except REDIS_ERRORS as exc:
            answer = exc


def recover_later(
    scripts: AsyncScripts, keys: Keys, key: str, token: str, route: HandoffRoute,
    sent_at: float, error: BaseException,
) -> None:  # fmt: skip
    """The asyncio twin of :func:`celery_semaphore.core.recovery.recover_later`: put right,
    from a task of the running loop that lives until it is done, a call of ``token`` on
    ``key`` sent at ``sent_at`` (``time.monotonic()``) that failed with ``error``. Never
    raises."""
    if (lost := lost_call(scripts, keys, key, token, route, sent_at, error)) is not None:
        _recovering.add(task := asyncio.ensure_future(_recover(lost)))
        task.add_done_callback(_recovering.discard)


_recovering: set[asyncio.Task[None]] = set()
"""The tasks of :func:`recover_later` still at work (the event loop holds tasks weakly)."""


async def _recover(lost: Lost[AsyncScripts]) -> None:
    while True:
        await asyncio.sleep(lost.due - time.monotonic())
        try:
            reply = await lost.scripts.run(lost.call(time.monotonic()))
        except Exception as exc:  # a redis-py error, or a client closed under us
            if lost.retry(exc, time.monotonic()):
                continue
        else:
            await deliver(lost.route, lost.key, lost.answered(reply), lost.scripts)
        return


class AsyncSlot(LeaseRecord[AsyncScripts]):
    """One held slot of an :class:`~celery_semaphore.asyncio.AsyncSemaphore`.

    Attributes:
        key (str): the semaphore's key.
        limit (int): the limit the slot was taken under.
        weight (int): how many units of the limit it takes (1 unless acquired with a weight).
        token (str): unique to this acquisition; proves ownership to Redis.
        lease (float): seconds the slot lives without an extend (updated by ``extend``).
        lost (asyncio.Event): set the moment the slot is known to be gone. A body can
            ``await slot.lost.wait()`` beside its work, or check ``slot.lost.is_set()``.
        acquired_at (float): epoch seconds, Redis clock.
        expires_at (float): epoch seconds, Redis clock, as of the last successful extend.

    A slot from :meth:`AsyncSemaphore.acquire` is not renewed in the background: call
    :meth:`extend` yourself, or use :meth:`AsyncSemaphore.hold` / :meth:`AsyncSemaphore.run`.
    ``async with slot:`` releases it on exit.
    """

    lost: asyncio.Event
    # The release, once asked for: one round trip however many callers await it, and
    # carried to its end even if they are cancelled.
    _released: asyncio.Future[bool] | None
    _new_lost = asyncio.Event
    _new_lock = contextlib.nullcontext  # one event loop: nothing to lock against

    def __init__(
        self,
        scripts: AsyncScripts,
        keys: Keys,
        key: str,
        limit: int,
        token: str,
        lease: float,
        admitted: Admitted,
        sent_at: float,
        handoffs: HandoffRoute,
        on_release: Callable[[AsyncSlot], object],
        weight: int = 1,
    ) -> None:
        super().__init__(scripts, keys, key, limit, token, lease, admitted, sent_at, handoffs,
                         weight)  # fmt: skip
        self._on_release = on_release

    # -- the holder's surface -------------------------------------------------------------

    async def extend(self, lease: float | None = None) -> bool:
        """Renew the lease for ``lease`` seconds from now (one round trip).

        Args:
            lease (float | None): new lease in seconds; None keeps the current one.

        Returns:
            bool: True when the slot was still ours and is extended; False when it is gone
            (lapsed, or taken by ``force_release_all``), in which case :attr:`lost` is set.
            False without a round trip once the slot was released.

        Raises:
            SemaphoreValidationError: ``lease`` is not a positive finite number of seconds.
            SemaphoreBackendError: the round trip failed; the slot may well still be ours.
        """
        ask = self._extend_call(lease)
        if ask is None:
            return False
        seconds, call = ask
        sent_at = time.monotonic()
        with backend_errors(self.key, self.limit):
            [expires_at_ms] = await self._scripts.run(call)
        return self._extended(sent_at, seconds, expires_at_ms)

    async def is_held(self) -> bool:
        """Ask the store whether this slot is still ours: present, with a lease that has not
        run out by the server's clock (one read-only round trip), as :meth:`Slot.is_held
        <celery_semaphore.core.slot.Slot.is_held>` does.

        It changes nothing, in the store or here: the lease is not renewed, and a False does
        not set :attr:`lost`.

        Returns:
            bool: True while the slot is held; False once it was released, lapsed, or taken
            away by an operator.

        Raises:
            SemaphoreBackendError: the round trip failed; nothing is known either way.
        """
        with backend_errors(self.key, self.limit):
            [held] = await self._scripts.run(held_call([(self._keys, self._member)]))
        return held

    async def release(self) -> bool:
        """Give the slot back (one round trip; later calls repeat the first answer). When
        waiters are parked on the key, the same call reserves the freed slot for the oldest,
        and its payload is published.

        A caller cancelled while it waits does not stop the release: it completes anyway.

        Returns:
            bool: True when the slot was ours up to now. False when it had lapsed or been
            taken away: the bound did not hold for the whole time it was used, and
            :attr:`lost` is set.

        Raises:
            SemaphoreBackendError: the round trip failed; the slot lapses within its lease
                (a later call tries again).
        """
        return await self._give_back_once(self._verdict())

    async def back_off(self, retry_after: object = None) -> float:
        """Give the slot back saying the provider refused its run as over its limit; see
        :meth:`Slot.back_off <celery_semaphore.core.slot.Slot.back_off>`.

        Returns:
            float: when the key's cool-down ends (epoch seconds, Redis clock); 0.0 for a
            slot released before.

        Raises:
            SemaphoreValidationError: ``retry_after`` is unreadable (nothing is sent).
            SemaphoreBackendError: the round trip failed.
        """
        if self._released is None:
            await self._give_back_once(self._verdict(True, retry_after))
        return self.cooling_until

    async def _give_back_once(self, verdict: tuple[str, ...]) -> bool:
        if self._released is None:
            self._released = asyncio.ensure_future(self._give_back(verdict))
            self._released.add_done_callback(self._released_or_failed)
        return await asyncio.shield(self._released)

    async def _give_back(self, verdict: tuple[str, ...]) -> bool:
        sent_at = time.monotonic()
        index, mark = self._handoffs.mark_before(self._keys, self.key, self.lease)
        try:
            if mark:
                await self._scripts.client.zadd(index, mark, xx=True, lt=True)
            call = release_call(self._keys, self._member, self._handoffs.release_claim_ms,
                                self.weight, verdict)  # fmt: skip
            released = await self._scripts.run(call)
        except REDIS_ERRORS as exc:
            # It may have run: its hand-off, or the slot, must not wait for a lease.
            recover_later(self._scripts, self._keys, self.key, self._member, self._handoffs,
                          sent_at, exc)  # fmt: skip
            raise backend_error(exc, self.key, self.limit) from exc
        self._on_release(self)
        self.cooling_until = released.cooling_until_ms / 1000
        owned = self._given_back(released.owned)
        await deliver(self._handoffs, self.key, released.handed, self._scripts)
        return owned

    def _released_or_failed(self, release: asyncio.Future[bool]) -> None:
        if release.cancelled() or release.exception() is not None:
            self._released = None  # not released: a later release() tries again

    async def __aenter__(self) -> AsyncSlot:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, BackOff):
            await self.back_off(exc.retry_after)
        else:
            await self.release()
