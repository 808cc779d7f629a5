"""A held slot: the lease a holder keeps alive, gives back, or learns it has lost.

:class:`Slot` is what :meth:`~celery_semaphore.core.semaphore.Semaphore.acquire` returns. Its
public surface is the holder's: ``key``, ``token``, ``limit``, ``weight``, ``lease``,
``acquired_at``, ``expires_at``, ``deadline``, ``lost``, ``when_lost``, ``extend``, ``is_held``,
``release``, ``released``. The renewer's side (``_renewal``, ``_renewed``, ``_renewed_at``,
``_mark_lost``, ``_check_deadline``, ``_on_lease_change``) is the package's own, shared with
:class:`~celery_semaphore.asyncio.slot.AsyncSlot` through
:class:`~celery_semaphore.core.lease.LeaseRecord`: underscored, so it stays out of the API
reference and of a user's completion.
"""

from __future__ import annotations

import logging
import threading
import time

from .calls import held_call, release_call
from .feedback import BackOff
from .lazy_event import LazyEvent
from .lease import LeaseRecord
from .recovery import recover_later
from .replies import Released
from .scripts import REDIS_ERRORS, Scripts, backend_error, backend_errors

logger = logging.getLogger(__name__)


class Slot(LeaseRecord[Scripts]):
    """One held slot of a semaphore, returned by :meth:`Semaphore.acquire`.

    Attributes:
        key (str): the semaphore's key.
        limit (int): the limit the slot was taken under.
        weight (int): how many units of the limit it takes (1 unless acquired with a weight).
        token (str): unique to this acquisition: how views and operators name the holder
            (the store knows it by its member, the token with the holder's record after it).
        lease (float): seconds the slot lives without an extend (updated by ``extend``).
        lost (threading.Event): set the moment the slot is known to be gone. Long bodies can
            poll ``slot.lost.is_set()`` or wait on it, to stop instead of running over the
            limit.
        acquired_at (float): epoch seconds, Redis clock.
        expires_at (float): epoch seconds, Redis clock, as of the last successful extend.
        cooling_until (float): after :meth:`back_off`, when the key's cool-down ends (epoch
            seconds, Redis clock); 0.0 before.

    A slot from :meth:`Semaphore.acquire` is not renewed in the background: call
    :meth:`extend` yourself, or use :meth:`Semaphore.hold` / :meth:`Semaphore.run`. A slot is
    also a context manager that releases it on exit (backs off, when the block raises
    :class:`~celery_semaphore.core.feedback.BackOff`).
    """

    lost: threading.Event
    _released: bool | None  # the answer, once given back
    _new_lost = LazyEvent
    # The renewer's thread may judge the loss while the body's asks when_lost.
    _new_lock = threading.Lock

    def extend(self, lease: float | None = None) -> bool:
        """Renew the lease for ``lease`` seconds from now (one round trip).

        Args:
            lease (float | None): new lease in seconds; None keeps the current one.

        Returns:
            bool: True when the slot was still ours and is extended; False when it is gone
            (lapsed, or taken by :meth:`Semaphore.force_release_all`), in which case
            :attr:`lost` is set. False without a round trip once the slot was released.

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
            [expires_at_ms] = self._scripts.run(call)
        return self._extended(sent_at, seconds, expires_at_ms)

    def is_held(self) -> bool:
        """Ask the store whether this slot is still ours: present, with a lease that has not
        run out by the server's clock (one read-only round trip).

        It changes nothing, in the store or here: the lease is not renewed, and a False does
        not set :attr:`lost` (the renewer, :meth:`extend` and :meth:`release` judge that).

        Returns:
            bool: True while the slot is held; False once it was released, lapsed, or taken
            away by an operator (:meth:`SemaphoreAdmin.force_release`, say).

        Raises:
            SemaphoreBackendError: the round trip failed; nothing is known either way.
        """
        with backend_errors(self.key, self.limit):
            [held] = self._scripts.run(held_call([(self._keys, self._member)]))
        return held

    def release(self) -> bool:
        """Give the slot back (one round trip; later calls repeat the first answer). When
        waiters are parked on the key, the same call reserves the freed slot for the oldest,
        and its payload is published (see :mod:`celery_semaphore.core.room`). On a key with
        an :class:`~celery_semaphore.core.feedback.Adaptive` limit it counts as a run that
        ended well.

        Returns:
            bool: True when the slot was ours up to now. False when it had lapsed or been
            taken away: the bound did not hold for the whole time it was used, and
            :attr:`lost` is set.

        Raises:
            SemaphoreBackendError: the round trip failed; the slot lapses within its lease.
        """
        return self._give_back(self._verdict())

    def back_off(self, retry_after: object = None) -> float:
        """Give the slot back saying the provider refused its run as over its limit: the key
        cools down fleet-wide, and an adaptive limit is cut (see
        :class:`~celery_semaphore.core.feedback.BackOff`). One round trip; nothing is sent
        for a slot already released.

        Args:
            retry_after (float | int | str | None): the provider's hint: seconds, or an HTTP
                date; None: none.

        Returns:
            float: when the key's cool-down ends (epoch seconds, Redis clock); 0.0 for a
            slot released before.

        Raises:
            SemaphoreValidationError: ``retry_after`` is negative or unreadable (nothing
                is sent).
            SemaphoreBackendError: the round trip failed; the slot lapses within its lease.
        """
        if self._released is None:
            self._give_back(self._verdict(True, retry_after))
        return self.cooling_until

    def _give_back(self, verdict: tuple[str, ...]) -> bool:
        if self._released is None:
            sent_at = time.monotonic()
            index, mark = self._handoffs.mark_before(self._keys, self.key, self.lease)
            try:
                if mark:
                    self._scripts.client.zadd(index, mark, xx=True, lt=True)
                reply: Released | Exception = self._scripts.release(
                    self._keys, self._member, self._handoffs.release_claim_ms, self.weight,
                    verdict,
                )  # fmt: skip
            except REDIS_ERRORS as exc:
                reply = exc
            self._take_release(reply, sent_at)
        return bool(self._released)

    def _take_release(self, reply: Released | Exception, sent_at: float) -> None:
        """Take in the answer to a release sent at ``sent_at`` (``time.monotonic()``):
        released, lost if it was not ours, its hand-offs sent on. An error in its place is
        raised; a redis-py one as :class:`SemaphoreBackendError`, once the call is handed to
        recovery (it may have run: its hand-off, or the slot, must not wait for a lease)."""
        if isinstance(reply, REDIS_ERRORS):
            recover_later(self._scripts, self._keys, self.key, self._member, self._handoffs,
                          sent_at, reply)  # fmt: skip
            raise backend_error(reply, self.key, self.limit) from reply
        if isinstance(reply, Exception):
            raise reply
        owned, handed, cooling_ms = reply
        self.cooling_until = cooling_ms / 1000
        self._released = self._given_back(owned)
        if handed:
            self._handoffs.deliver(self.key, handed, self._scripts)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, BackOff):
            self.back_off(exc.retry_after)
        else:
            self.release()


def give_back(slots: list[Slot]) -> None:
    """Give back each of ``slots`` not given back yet, as runs that ended well (the release
    thread's and a prefork pool process's path:
    :func:`~celery_semaphore.core.heartbeat.release_later`). Those of one client go in one
    pipelined round trip (redis-py's cluster pipeline makes it one per node); a slot whose
    release writes the room index first
    (:meth:`~celery_semaphore.core.handoff.HandoffRoute.mark_before`) goes in its own.

    Never raises: a failure is logged, and a lost reply put right, as for
    :meth:`Slot.release`."""
    clients: dict[int, list[Slot]] = {}
    for slot in slots:
        if slot._released is None:  # not given back by the body itself
            alone = slot._handoffs.mark_before(slot._keys, slot.key, slot.lease)[1]
            clients.setdefault(id(slot) if alone else id(slot._scripts), []).append(slot)
    for rows in clients.values():
        sent_at = time.monotonic()
        try:
            if len(rows) == 1:
                rows[0].release()
                continue
            replies = rows[0]._scripts.run_many([
                release_call(s._keys, s._member, s._handoffs.release_claim_ms, s.weight,
                             s._verdict()) for s in rows
            ])  # fmt: skip
        except Exception as exc:  # which ran is not known: each is put right if it may have
            replies = [exc] * len(rows)
        for slot, reply in zip(rows, replies, strict=True):
            try:
                slot._take_release(reply, sent_at)  # raises an error in place of an answer
            except Exception:
                logger.warning("could not release slot of semaphore %r", slot.key, exc_info=True)
