"""Put right a room call whose answer was lost: no slot stands reserved for a run nobody
starts because a reply timed out.

A release, park, claim, sweep, cancel or live-limit change sent to a store that then froze
(or whose connection dropped) may still run when the store wakes: it can reserve a freed
slot for the oldest parked run, or take a slot, and nobody learns of it. The reservation
would stand idle until its claim lease ends (``claim_timeout``, 30 s), and the slot until
its lease does. So a caller that gets no answer hands the call to a recoverer that asks the
store again, with a backoff, until it answers, and then runs ``recover.lua``: the slot the
call's token may hold goes back, and every reservation made since the call was sent is
published again through the call's hand-off route (a duplicate copy of a run's hand-off ends
quietly when it starts; see the waiting-room how-to). What to remember, what to send when,
and what an answer or a failure means are decided here, without I/O (:class:`Lost`), for
both twins: a sync client's calls are put right by this process's daemon thread, an
asyncio client's by a task of its event loop
(:func:`celery_semaphore.asyncio.slot.recover_later`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from redis.exceptions import ResponseError

from . import process
from .calls import Call, recover_call
from .handoff import HandoffRoute
from .names import Keys
from .replies import Handoff, Released
from .scripts import REDIS_ERRORS, Scripts

logger = logging.getLogger(__name__)

S = TypeVar("S")

FIRST_TRY = 0.5
"""Seconds before the first try: a dropped connection is often back at once."""
MAX_BACKOFF = 5.0
"""Longest wait between two tries, seconds: the store is asked at least this often."""
GIVE_UP_AFTER = 600.0
"""Seconds after which a call is left to its leases (every one has lapsed by then)."""


@dataclass(eq=False)
class Lost(Generic[S]):
    """A call whose answer was lost, to put right through the ``scripts`` (sync or asyncio)
    it went through: ``token`` ("" for none) on ``key`` (whose Redis keys are ``keys``),
    sent at ``sent_at`` (``time.monotonic()``), its hand-offs going through ``route``; the
    next try is ``due`` then (``time.monotonic()``), ``backoff`` seconds after the last.
    The decisions of both twins' recoverers, with no I/O: a recoverer sends :meth:`call`
    when it is due, and delivers what :meth:`answered` makes of the reply, or asks
    :meth:`retry` after an error."""

    scripts: S
    keys: Keys
    key: str
    token: str
    route: HandoffRoute
    sent_at: float
    due: float
    backoff: float = FIRST_TRY

    def call(self, now: float) -> Call[Released]:
        """The recover.lua call to send at ``now`` (``time.monotonic()``)."""
        claim_ms, since_ms = self.route.release_claim_ms, round((now - self.sent_at) * 1000)
        return recover_call(self.keys, self.token, claim_ms, since_ms)

    def answered(self, reply: Released) -> list[Handoff]:
        """The hand-offs to deliver through :attr:`route` (with :attr:`scripts`) after the
        :meth:`call` answered ``reply``."""
        released, handed, _ = reply
        if released or handed:
            logger.info(
                "semaphore %r: put right a call whose answer was lost: %s, %d hand-off(s) "
                "published again", self.key, "its slot given back" if released else "no slot",
                len(handed),
            )  # fmt: skip
        return handed

    def retry(self, error: Exception, now: float) -> bool:
        """Whether to send :meth:`call` again, at :attr:`due` (set here), after it failed
        with ``error`` at ``now``: False (logged) for an error that is not the store's (a
        client closed under it, say), or after :data:`GIVE_UP_AFTER`."""
        if now - self.sent_at > GIVE_UP_AFTER or not isinstance(error, REDIS_ERRORS):
            logger.warning("semaphore %r: gave up putting right a lost call: %s", self.key, error)
            return False
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)
        self.due = now + self.backoff
        return True


def lost_call(
    scripts: S, keys: Keys, key: str, token: str, route: HandoffRoute, sent_at: float,
    error: BaseException,
) -> Lost[S] | None:  # fmt: skip
    """What to put right after a call that failed with ``error`` (see :class:`Lost` for the
    rest), due :data:`FIRST_TRY` seconds from now; None when there is nothing to do: the
    store answered ``error`` (the call did not run), or there is neither a token nor a
    publisher."""
    if isinstance(error, ResponseError) or not (token or route.publisher):
        return None
    return Lost(scripts, keys, key, token, route, sent_at, time.monotonic() + FIRST_TRY)


_pending: list[Lost[Scripts]] = []  # this process's lost calls of sync clients
_added = threading.Condition()  # held over _pending; notified as a call is added
_pid = 0  # of the process whose thread puts them right (none yet: 0)


def _add(lost: Lost[Scripts]) -> None:
    global _pid
    with _added:
        if _pid != process.pid():  # none yet, or one of the parent's before a fork
            _pid = process.pid()
            _pending.clear()
            threading.Thread(target=_recover, name="semaphore-recovery", daemon=True).start()
        _pending.append(lost)
        _added.notify()


def _recover() -> None:
    while True:
        with _added:
            now = time.monotonic()
            due = [lost for lost in _pending if lost.due <= now]
            if not due:  # until the next is due, or one is added
                _added.wait(min((lost.due - now for lost in _pending), default=None))
        for lost in due:
            try:
                reply = lost.scripts.run(lost.call(time.monotonic()))
            except Exception as exc:  # a redis-py error, or a client closed under us
                if lost.retry(exc, time.monotonic()):
                    continue
            else:
                lost.route.deliver(lost.key, lost.answered(reply), lost.scripts)
            with _added:
                _pending.remove(lost)


def idle() -> bool:
    """Whether this process has no lost call left to put right: none waiting, none being put
    right now (each one leaves the recoverer's list once it is done with); a test waits for
    this before it reads what a recovery published."""
    with _added:
        return not _pending


def recover_later(
    scripts: Scripts, keys: Keys, key: str, token: str, route: HandoffRoute, sent_at: float,
    error: BaseException,
) -> None:  # fmt: skip
    """Put right, once the store answers again, a call of ``token`` ("" for none) on ``key``
    sent at ``sent_at`` (``time.monotonic()``) that failed with ``error``; see the module
    and :func:`lost_call`. Never raises."""
    if (lost := lost_call(scripts, keys, key, token, route, sent_at, error)) is not None:
        _add(lost)


class recovering:
    """Within the block, a redis-py error of a room call of ``token`` ("" for none) on
    ``key`` hands the call to :func:`recover_later` (sent when the block was entered) and
    propagates. A class rather than a generator: it wraps room round trips.

    Args:
        scripts (Scripts): the scripts the call went through.
        keys (Keys): the key's Redis keys.
        key (str): the semaphore's key.
        token (str): the call's token, or "".
        route (HandoffRoute): where the call's hand-offs go.
    """

    __slots__ = ("key", "keys", "route", "scripts", "sent_at", "token")

    def __init__(
        self, scripts: Scripts, keys: Keys, key: str, token: str, route: HandoffRoute
    ) -> None:
        self.scripts, self.keys, self.key, self.token, self.route = scripts, keys, key, token, route
        self.sent_at = 0.0

    def __enter__(self) -> None:
        self.sent_at = time.monotonic()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if isinstance(exc, REDIS_ERRORS):
            recover_later(self.scripts, self.keys, self.key, self.token, self.route,
                          self.sent_at, exc)  # fmt: skip
