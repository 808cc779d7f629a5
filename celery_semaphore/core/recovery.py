"""Put right a room call whose answer was lost: no slot stands reserved for a run nobody
starts because a reply timed out.

A release, park, claim, sweep, cancel or live-limit change sent to a store that then froze
(or whose connection dropped) may still run when the store wakes: it can reserve a freed
slot for the oldest parked run, or take a slot, and nobody learns of it. The reservation
would stand idle until its claim lease ends (``claim_timeout``, 30 s), and the slot until
its lease does. So a caller that gets no answer hands the call to this process's recoverer,
a daemon thread that asks the store again, with a backoff, until it answers, and then runs
``recover.lua``: the slot the call's token may hold goes back, and every reservation made
since the call was sent is published again through the call's hand-off route (a duplicate
copy of a run's hand-off ends quietly when it starts; see the waiting-room how-to).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

from redis.exceptions import ResponseError

from . import process
from .handoff import HandoffRoute
from .names import Keys
from .scripts import REDIS_ERRORS, Scripts

logger = logging.getLogger(__name__)

FIRST_TRY = 0.5
"""Seconds before the first try: a dropped connection is often back at once."""
MAX_BACKOFF = 5.0
"""Longest wait between two tries, seconds: the store is asked at least this often."""
GIVE_UP_AFTER = 600.0
"""Seconds after which a call is left to its leases (every one has lapsed by then)."""


@dataclass
class _Lost:
    scripts: Scripts
    keys: Keys
    key: str
    token: str
    route: HandoffRoute
    sent_at: float
    due: float
    backoff: float = FIRST_TRY


class _Recoverer:
    """The calls of this process waiting to be put right, and the thread that does it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: collections.deque[_Lost] = collections.deque()
        self._pid = 0

    def idle(self) -> bool:
        """Whether no call waits to be put right, nor is being put right now (the thread
        clears its wake only once it has nothing left)."""
        with self._lock:
            return not self._pending and not self._wake.is_set()

    def add(self, lost: _Lost) -> None:
        with self._lock:
            self._pending.append(lost)
            if self._pid != process.pid():  # none yet, or one of the parent's before a fork
                self._pid = process.pid()
                self._pending = collections.deque([lost])
                threading.Thread(target=self._run, name="semaphore-recovery", daemon=True).start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                jobs, self._pending = list(self._pending), collections.deque()
            now = time.monotonic()
            later = [job for job in jobs if not self._try(job, now)]
            with self._lock:
                self._pending.extendleft(reversed(later))
                if not self._pending:
                    self._wake.clear()
                    wait: float | None = None
                else:
                    wait = max(0.0, min(job.due for job in self._pending) - time.monotonic())
            self._wake.wait(wait)

    @staticmethod
    def _try(job: _Lost, now: float) -> bool:
        """Run ``job`` if it is due; True when it is done with (run, or given up)."""
        if now < job.due:
            return False
        since_ms = round((now - job.sent_at) * 1000)
        try:
            released, handed = job.scripts.recover(
                job.keys, job.token, job.route.release_claim_ms, since_ms
            )
        except Exception as exc:  # a redis-py error, or a client closed under us
            if now - job.sent_at > GIVE_UP_AFTER or not isinstance(exc, REDIS_ERRORS):
                logger.warning("semaphore %r: gave up putting right a lost call: %s", job.key, exc)
                return True
            job.backoff = min(job.backoff * 2, MAX_BACKOFF)
            job.due = now + job.backoff
            return False
        if released or handed:
            logger.info(
                "semaphore %r: put right a call whose answer was lost: %s, %d hand-off(s) "
                "published again", job.key, "its slot given back" if released else "no slot",
                len(handed),
            )  # fmt: skip
        job.route.deliver(job.key, handed, job.scripts)
        return True


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
    sent at ``sent_at`` (``time.monotonic()``) that failed with ``error``; see the module.
    Nothing to do for an error the store answered with (the call did not run), or when
    there is neither a token nor a publisher. Never raises."""
    if isinstance(error, ResponseError) or not (token or route.publisher):
        return
    _RECOVERER.add(_Lost(scripts, keys, key, token, route, sent_at, time.monotonic() + FIRST_TRY))


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
