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
and what an answer or a failure means are decided here, without I/O (:class:`LostCalls`),
for both twins: a sync client's calls are put right by this process's daemon thread, an
asyncio client's by a task of its event loop
(:func:`celery_semaphore.asyncio.slot.recover_later`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from redis.exceptions import ResponseError

from . import process
from .calls import Call, recover_call
from .handoff import HandoffRoute
from .names import Keys
from .replies import Handoff
from .scripts import REDIS_ERRORS, Scripts

logger = logging.getLogger(__name__)

S = TypeVar("S")
"""The scripts a lost call went through: :class:`~.scripts.Scripts` or ``AsyncScripts``."""

FIRST_TRY = 0.5
"""Seconds before the first try: a dropped connection is often back at once."""
MAX_BACKOFF = 5.0
"""Longest wait between two tries, seconds: the store is asked at least this often."""
GIVE_UP_AFTER = 600.0
"""Seconds after which a call is left to its leases (every one has lapsed by then)."""


@dataclass
class Lost(Generic[S]):
    """A call whose answer was lost, to put right through the ``scripts`` it went through:
    ``token`` ("" for none) on ``key`` (whose Redis keys are ``keys``), sent at ``sent_at``
    (``time.monotonic()``), its hand-offs going through ``route``. :class:`LostCalls` sets
    ``due`` (``time.monotonic()``) and ``backoff`` (seconds)."""

    scripts: S
    keys: Keys
    key: str
    token: str
    route: HandoffRoute
    sent_at: float
    due: float = 0.0
    backoff: float = 0.0

    def answered(self, reply: tuple[bool, list[Handoff]]) -> list[Handoff]:
        """What the driver delivers through :attr:`route` (with :attr:`scripts`) once the
        recover call of :meth:`LostCalls.due` answered ``reply``."""
        released, handed = reply
        if released or handed:
            logger.info(
                "semaphore %r: put right a call whose answer was lost: %s, %d hand-off(s) "
                "published again", self.key, "its slot given back" if released else "no slot",
                len(handed),
            )  # fmt: skip
        return handed


def lost_call(
    scripts: S, keys: Keys, key: str, token: str, route: HandoffRoute, sent_at: float,
    error: BaseException,
) -> Lost[S] | None:  # fmt: skip
    """The :class:`Lost` to put right after a call that failed with ``error`` (see
    :class:`Lost` for the rest); None when there is nothing to do: the store answered
    ``error`` (the call did not run), or there is neither a token nor a publisher."""
    if isinstance(error, ResponseError) or not (token or route.publisher):
        return None
    return Lost(scripts, keys, key, token, route, sent_at)


class LostCalls(Generic[S]):
    """The lost calls one driver puts right, sans I/O: when to ask the store, with which
    call, and what a failure means. The sync side's driver is this process's thread; the
    asyncio side's, its event loop's renewer. A driver sends the call of each lost call
    :meth:`due` hands it, and delivers what :meth:`Lost.answered` makes of the reply, or
    hands the error to :meth:`failed`; it waits until :meth:`next_due` meanwhile."""

    def __init__(self) -> None:
        self._waiting: list[Lost[S]] = []

    def __bool__(self) -> bool:
        """Whether a call waits to be sent (one that :meth:`due` handed out does not)."""
        return bool(self._waiting)

    def add(self, lost: Lost[S], now: float) -> None:
        """Put ``lost`` right from :data:`FIRST_TRY` seconds after ``now`` on."""
        lost.due, lost.backoff = now + FIRST_TRY, FIRST_TRY
        self._waiting.append(lost)

    def next_due(self) -> float:
        """When the next call is due (``time.monotonic()``); infinity when none waits."""
        return min((lost.due for lost in self._waiting), default=math.inf)

    def due(self, now: float) -> list[tuple[Lost[S], Call[tuple[bool, list[Handoff]]]]]:
        """The calls due at ``now``, handed out (:meth:`failed` takes one back), each with
        the recover.lua call to send for it."""
        due = [lost for lost in self._waiting if lost.due <= now]
        self._waiting = [lost for lost in self._waiting if lost.due > now]
        return [
            (lost, recover_call(lost.keys, lost.token, lost.route.release_claim_ms,
                                round((now - lost.sent_at) * 1000)))
            for lost in due
        ]  # fmt: skip

    def failed(self, lost: Lost[S], error: Exception, now: float) -> None:
        """``lost``'s recover call failed with ``error`` at ``now``: it is due again after a
        longer wait, or given up (logged) when ``error`` is not the store's (a client closed
        under it, say) or :data:`GIVE_UP_AFTER` has passed."""
        if now - lost.sent_at > GIVE_UP_AFTER or not isinstance(error, REDIS_ERRORS):
            logger.warning("semaphore %r: gave up putting right a lost call: %s", lost.key, error)
            return
        lost.backoff = min(lost.backoff * 2, MAX_BACKOFF)
        lost.due = now + lost.backoff
        self._waiting.append(lost)


class _Recoverer:
    """This process's lost calls of sync clients, and the thread that puts them right."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._calls: LostCalls[Scripts] = LostCalls()
        self._busy = False
        self._pid = 0

    def idle(self) -> bool:
        """Whether no call waits to be put right, nor is being put right now."""
        with self._lock:
            return not self._calls and not self._busy

    def add(self, lost: Lost[Scripts]) -> None:
        with self._lock:
            if self._pid != process.pid():  # none yet, or one of the parent's before a fork
                self._pid, self._calls = process.pid(), LostCalls()
                threading.Thread(target=self._run, name="semaphore-recovery", daemon=True).start()
            self._calls.add(lost, time.monotonic())
        self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._wake.clear()  # set again by a call added from here on
                due = self._calls.due(time.monotonic())
                self._busy = bool(due)
            for lost, call in due:
                try:
                    reply = lost.scripts.run(call)
                except Exception as exc:  # a redis-py error, or a client closed under us
                    with self._lock:
                        self._calls.failed(lost, exc, time.monotonic())
                    continue
                lost.route.deliver(lost.key, lost.answered(reply), lost.scripts)
            with self._lock:
                self._busy = False
                wait = self._calls.next_due() - time.monotonic()
            self._wake.wait(None if wait == math.inf else max(0.0, wait))


_RECOVERER = _Recoverer()


def idle() -> bool:
    """Whether this process has no lost call left to put right: none waiting, none being put
    right now (a test waits for this before it reads what a recovery published)."""
    return _RECOVERER.idle()


def recover_later(
    scripts: Scripts, keys: Keys, key: str, token: str, route: HandoffRoute, sent_at: float,
    error: BaseException,
) -> None:  # fmt: skip
    """Put right, once the store answers again, a call of ``token`` ("" for none) on ``key``
    sent at ``sent_at`` (``time.monotonic()``) that failed with ``error``; see the module
    and :func:`lost_call`. Never raises."""
    if (lost := lost_call(scripts, keys, key, token, route, sent_at, error)) is not None:
        _RECOVERER.add(lost)


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
