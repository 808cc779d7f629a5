"""What operator tools need from the lease algorithm, without a limit: every semaphore under a
prefix, its live holders, force release and live limits.

A :class:`~celery_semaphore.core.semaphore.Semaphore` owns one (``sem.admin``); the views
(CLI, ``celery inspect semaphores``, Flower) and the worker's dead-run release make their
own, since they see semaphores whose limit they do not know.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import redis

from . import validation as check
from .calls import (
    Call,
    force_release_all_call,
    holders_call,
    pause_call,
    release_call,
    set_limit_call,
)
from .handoff import DEFAULT_CLAIM_TIMEOUT, HandoffRoute
from .live import Feedback as Feedback
from .live import LiveLimit as LiveLimit
from .live import Pause as Pause
from .live import (
    feedback_of,
    live_limit_of,
    log_limit_change,
    log_pause_change,
    log_rate_change,
    pause_of,
    set_rate_call,
    setter,
    text_of,
)
from .names import Keys, Namespace
from .process import holder_member, member_pattern, token_of
from .rates import Rate, check_rate_name
from .recovery import recover_later
from .replies import Handoff, Released
from .scripts import REDIS_ERRORS, Scripts, backend_error, backend_errors

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "semaphore"

_GLOB = re.compile(r"([*?\[\]\\])")

# What a force release and a pause answer: a flag, and the hand-offs made.
Freed = tuple[bool, list[Handoff]]


@dataclass(frozen=True)
class Holder:
    """One live holder of a semaphore, as Redis records it.

    Attributes:
        token (str): the acquisition's unique token.
        acquired_at (float): when the slot was taken, epoch seconds: by the acquiring
            host's clock when it sent the acquire, for a holder whose record rides in its
            member (a plain acquire); by the Redis clock for the others.
        expires_at (float): when the lease lapses unless extended, epoch seconds (Redis clock).
        expires_in (float): seconds from the server's "now" to ``expires_at``.
        held_for (float): seconds from ``acquired_at`` to the server's "now" (never below 0).
        metadata (Mapping[str, Any]): ``host``, ``pid`` and ``limit`` of the holder, plus
            whatever it attached (a Celery task's id and name, say).
    """

    token: str
    acquired_at: float
    expires_at: float
    expires_in: float
    held_for: float
    metadata: Mapping[str, Any] = field(default_factory=dict)


def holder_from_reply(token: str, expires_at_ms: int, info: str, now_ms: int) -> Holder:
    """A :class:`Holder` from one row of holders.lua's reply (see its contract)."""
    acquired, _, raw = info.partition("|")
    try:
        metadata = json.loads(raw) if raw else {}
    except ValueError:
        metadata = {"raw": raw}
    acquired_ms = int(acquired) if acquired.isdigit() else now_ms
    return Holder(
        token=token,
        acquired_at=acquired_ms / 1000,
        expires_at=expires_at_ms / 1000,
        expires_in=(expires_at_ms - now_ms) / 1000,
        # A record in a member was stamped by its host's clock, which may run ahead.
        held_for=max(0, now_ms - acquired_ms) / 1000,
        metadata=metadata,
    )


class KeyScan:
    """One SCAN (never KEYS) for the keys of every semaphore under ``prefix``, without I/O:
    what to ask (:attr:`match`, :attr:`kind`), and the keys its replies name (:attr:`found`).

    Args:
        prefix (str): the semaphores' namespace.
        limit (int): how many keys are enough, so a huge keyspace cannot stall a caller.
        rooms (bool): only the keys with a waiting room.
        limits (bool): only the keys with a live limit (which outlives their slots).
    """

    def __init__(self, prefix: str, limit: int, rooms: bool, limits: bool) -> None:
        self.head, self.tail = f"{prefix}:{{", "}:room" if rooms else "}:limits" if limits else "}"
        self.match = _GLOB.sub(r"\\\1", self.head) + "*" + self.tail
        self.kind = "hash" if limits else "zset"
        self.limit, self.found = limit, list[str]()

    def enough(self, raw: bytes | str) -> bool:
        """Keep the key that the Redis key ``raw`` names (SCAN matched it to :attr:`match`,
        so it starts with the head and ends with the tail); True once ``limit`` keys are
        kept."""
        self.found.append(text_of(raw)[len(self.head) : -len(self.tail)])
        return len(self.found) >= self.limit


def scan_keys(
    client: redis.Redis, prefix: str, limit: int = 10_000, rooms: bool = False,
    limits: bool = False,
) -> list[str]:  # fmt: skip
    """The keys of every semaphore under ``prefix``, sorted; the arguments are
    :class:`KeyScan`'s.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    scan = KeyScan(prefix, limit, rooms, limits)
    with backend_errors(f"{prefix}:*"):
        for raw in client.scan_iter(match=scan.match, count=500, _type=scan.kind):
            if scan.enough(raw):
                break
    return sorted(scan.found)


def eviction_warnings(config: Mapping[Any, Any]) -> list[str]:
    """What about the server could break the semaphore's promise, from its ``CONFIG GET
    maxmemory-policy`` reply: the sync and asyncio admins' ``server_warnings``.

    An evicting ``maxmemory-policy`` may delete a semaphore's key (they carry a TTL, so
    even the ``volatile-*`` policies pick them), which silently resets the count to zero
    and lets up to ``limit`` more holders in. Only ``noeviction`` is safe.

    Returns:
        list[str]: one sentence a problem; empty when none is found.
    """
    policy = text_of(config.get("maxmemory-policy") or "")
    if policy in ("", "noeviction"):
        return []
    return [
        f"Redis maxmemory-policy is {policy!r}: under memory pressure it may evict a "
        "semaphore's key, resetting its count and admitting more than its limit; "
        "use 'noeviction' for the semaphore store"
    ]


def decision_of(decision: str, key: str, value: object, by: str) -> tuple[str, str]:
    """The entry an operator's change writes to the hash ``<prefix>:decisions``, which the
    workers copy to put back what a restart of the store loses: the field
    ``"<decision> <key>"`` (``pause``, ``limit`` or ``rate:<name>``) and ``[value, by,
    at_ms]`` in JSON, at this host's clock; a clear keeps its entry with value None, so a
    copy older than it is never put back."""
    return f"{decision} {key}", json.dumps([value, by, int(time.time() * 1000)])


R = TypeVar("R")
A = TypeVar("A")


@dataclass(frozen=True)
class RoundTrip(Generic[R, A]):
    """One round trip of an admin on ``key``, decided without I/O for the sync and the
    asyncio twin alike (:class:`AdminTrips` makes them); each twin only does its I/O
    (``_make``), in this order: write :attr:`before` to the room index (``ZADD XX LT``: see
    :meth:`HandoffRoute.mark_before`), send :attr:`call`, write :attr:`after` (``ZADD XX``)
    and an operator's :attr:`decision` to the decisions hash (in a slot of its own on a
    cluster, so not from the script).
    A redis-py error is handed to the twin's ``recover_later`` with :attr:`token` (None: the
    call needs no recovery) and raised as a backend error of ``key`` and :attr:`limit`. Then
    :attr:`read` makes of the reply the answer and the hand-offs to deliver, and logs what
    changed."""

    key: str
    call: Call[R]
    read: Callable[[R], tuple[A, list[Handoff]]]
    before: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    token: str | None = None
    limit: int | None = None
    decision: tuple[str, str] | None = None


class AdminTrips:
    """What :class:`SemaphoreAdmin` and its asyncio twin decide, without I/O: the checks of
    each of their round trips and the :class:`RoundTrip` to make; the twins make them."""

    names: Namespace
    handoffs: HandoffRoute

    def keys_of(self, key: str) -> Keys:
        """The Redis keys of ``key`` (see :meth:`Namespace.keys_of`).

        Raises:
            SemaphoreValidationError: ``key`` starts with ``}`` and the client is a cluster's.
        """
        return self.names.keys_of(key)

    def _freeing(
        self, key: str, call: Call[R], read: Callable[[R], tuple[A, list[Handoff]]],
        token: str | None = "", limit: int | None = None, now: bool = False,
        decision: tuple[str, str] | None = None,
    ) -> RoundTrip[R, A]:  # fmt: skip
        """A round trip that may free slots of ``key``: its room's sweep brought on before
        it (see :meth:`HandoffRoute.mark_before`), and when ``now``, due at once after it."""
        _, before = self.handoffs.mark_before(self.keys_of(key), key)
        return RoundTrip(key, call, read, before, {key: 0} if now else {}, token, limit, decision)

    def _holders_trip(self, key: str) -> RoundTrip[tuple[int, list[tuple[str, int, str]]],
                                                   list[Holder]]:  # fmt: skip
        key = check.check_key(key)
        return RoundTrip(
            key, holders_call(self.keys_of(key)),
            lambda reply: ([holder_from_reply(*row, reply[0]) for row in reply[1]], []),
        )  # fmt: skip

    def _release_trip(self, key: str, member: str) -> RoundTrip[Released, bool]:
        def read(reply: Released) -> Freed:
            if reply.owned:
                logger.warning("semaphore %r: holder %s force-released", key, token_of(member))
            return reply.owned, reply.handed

        # A reservation taken away is due in its room now (its waiter goes back in line), but
        # the room's score says when its last sweep thought: bring it on.
        return self._freeing(
            key, release_call(self.keys_of(key), member, self.handoffs.release_claim_ms, None),
            read, member, now=member.startswith("~"),
        )  # fmt: skip

    def _release_all_trip(self, key: str) -> RoundTrip[int, int]:
        key = check.check_key(key)

        def read(displaced: int) -> tuple[int, list[Handoff]]:
            logger.warning("semaphore %r: every slot force-released, %d live holder(s) "
                           "displaced", key, displaced)  # fmt: skip
            return displaced, []

        # The freed slots wait for the room's next sweep: bring it on. It hands nothing off:
        # a lost answer leaves nothing to put right.
        return self._freeing(key, force_release_all_call(self.keys_of(key)), read, None, now=True)

    def _limit_trip(
        self, key: str, limit: int | None, by: str | None
    ) -> RoundTrip[tuple[int | None, int, list[Handoff]], int | None]:
        key = check.check_key(key)
        limit = None if limit is None else check.check_limit(limit)
        who = setter(by)

        def read(reply: tuple[int | None, int, list[Handoff]]) -> tuple[int | None, list[Handoff]]:
            previous, _, handed = reply
            log_limit_change(key, limit, previous, who)
            return previous, handed

        call = set_limit_call(self.keys_of(key), limit, who, self.handoffs.release_claim_ms)
        return self._freeing(key, call, read, limit=limit,
                             decision=decision_of("limit", key, limit, who))  # fmt: skip

    def _pause_trip(self, key: str, paused: bool, by: str | None) -> RoundTrip[Freed, bool]:
        key, who = check.check_key(key), setter(by)

        def read(reply: Freed) -> Freed:
            log_pause_change(key, paused, reply[0], who)
            return reply

        call = pause_call(self.keys_of(key), paused, who, self.handoffs.release_claim_ms)
        return self._freeing(key, call, read, decision=decision_of("pause", key, paused or None,
                                                                   who))  # fmt: skip

    def _rate_trip(
        self, key: str, rate: str | float | Rate | None, name: str, by: str | None
    ) -> RoundTrip[tuple[str | None, int], str | None]:
        key, name = check.check_key(key), check_rate_name(name, "rate ")
        # A spelling stands for ``Rate(spelling, name=name)``; a Rate's own name wins.
        new = rate if rate is None or isinstance(rate, Rate) else Rate(rate, name=name)
        name, who = name if new is None else new.name, setter(by)

        def read(reply: tuple[str | None, int]) -> tuple[str | None, list[Handoff]]:
            log_rate_change(key, name, new, reply[0], who)
            return reply[0], []

        return RoundTrip(key, set_rate_call(self.keys_of(key), name, new, who), read,
                         decision=decision_of(f"rate:{name}", key, new and [new.spec, new.burst],
                                              who))  # fmt: skip


class SemaphoreAdmin(AdminTrips):
    """Read and free the slots of every semaphore under ``prefix``, whatever its limit.

    Args:
        client (redis.Redis): where the semaphores live (a cluster client works too).
        prefix (str): their key namespace (default ``"semaphore"``).
        scripts (Scripts | None): the registered scripts to send through (a
            :class:`~celery_semaphore.Semaphore` shares its own); None: its own.

    Raises:
        SemaphoreValidationError: ``prefix`` is not a non-empty str.
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = DEFAULT_PREFIX,
        handoffs: HandoffRoute | None = None,
        *,
        scripts: Scripts | None = None,
    ) -> None:
        self.client = client
        self.handoffs = handoffs or HandoffRoute(DEFAULT_CLAIM_TIMEOUT, None)
        self.prefix = check.check_key(prefix, "prefix")
        self._scripts = scripts or Scripts(client)
        self.names = Namespace(self.prefix, isinstance(client, redis.RedisCluster))

    def _make(self, trip: RoundTrip[R, A]) -> A:  # see RoundTrip; the asyncio twin's is alike
        sent_at = time.monotonic()
        try:
            if trip.before:
                self.client.zadd(self.names.room_index, trip.before, xx=True, lt=True)
            reply = self._scripts.run(trip.call)
            if trip.after:
                self.client.zadd(self.names.room_index, trip.after, xx=True)
            if trip.decision:
                self.client.hset(f"{self.prefix}:decisions", *trip.decision)
        except REDIS_ERRORS as exc:
            if trip.token is not None:
                recover_later(self._scripts, self.keys_of(trip.key), trip.key, trip.token,
                              self.handoffs, sent_at, exc)  # fmt: skip
            raise backend_error(exc, trip.key, trip.limit) from exc
        answer, handed = trip.read(reply)
        self.handoffs.deliver(trip.key, handed, self._scripts)
        return answer

    def scan_keys(
        self, limit: int = 10_000, rooms: bool = False, limits: bool = False
    ) -> list[str]:
        """The keys of every semaphore under the prefix; see :func:`scan_keys`.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        return scan_keys(self.client, self.prefix, limit, rooms, limits)

    def holders(self, key: str) -> list[Holder]:
        """Every live holder of ``key``, soonest expiry first (one round trip).

        Args:
            key (str): the semaphore's key.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        return self._make(self._holders_trip(key))

    def force_release(self, key: str, token: str) -> bool:
        """Free one holder's slot by its token (from :meth:`holders`), as an operator would.

        Returns:
            bool: True when that holder was live until now.

        Raises:
            SemaphoreValidationError: ``key`` or ``token`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        key, token = check.check_key(key), check.check_key(token, "token")
        with backend_errors(key):  # the views show a token; the store may know a member
            found = self.client.zscan_iter(self.keys_of(key).slots, match=member_pattern(token))
            member = holder_member(token, (text_of(member) for member, _ in found))
        return self._make(self._release_trip(key, member))

    def force_release_all(self, key: str) -> int:
        """Free every slot of ``key`` at once (an operator's recovery tool).

        The displaced holders keep running; each learns of it at its next renewal or release,
        which answers "gone".

        Returns:
            int: how many live holders were displaced.

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        return self._make(self._release_all_trip(key))

    def live_limit(self, key: str) -> LiveLimit | None:
        """The live limit of ``key``, or None when none is set (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(key):
            return live_limit_of(self.client.hgetall(self.keys_of(check.check_key(key)).limits))

    def set_limit(self, key: str, limit: int | None, by: str | None = None) -> int | None:
        """Set the live limit of ``key``, which wins over the limit every caller gives until it
        is cleared; None clears it (callers' own limits apply again). One round trip; the
        change is logged (who, from which host and pid) and shown by the views.

        Lowering the limit evicts no holder: new ones are refused until the key is under it.
        Raising it hands the freed capacity to the oldest parked waiters in the same script
        call (published through this admin's hand-off route; with no publisher, the next
        sweep hands them out) and wakes callers waiting in ``acquire(wait=...)``.

        Args:
            key (str): the semaphore's key.
            limit (int | None): the new limit (1 to 2**31 - 1), or None to clear.
            by (str | None): who sets it, for the views; None: ``user@host pid N``.

        Returns:
            int | None: the live limit it replaced (None: there was none).

        Raises:
            SemaphoreValidationError: ``key``, ``limit`` or ``by`` is invalid (nothing is sent).
            SemaphoreBackendError: Redis failed.
        """
        return self._make(self._limit_trip(key, limit, by))

    def pause(self, key: str, by: str | None = None) -> bool:
        """Pause ``key`` for the whole fleet. While it is paused the limit
        that applies is 0: running bodies finish and keep renewing their slots, nothing new
        starts (an acquire is refused with ``Refusal.PAUSED``, a queueing run parks), and a
        release hands nothing off. A live limit is left as it is. Who did it
        and when is recorded in Redis and shown by the views; the change is logged. One
        round trip.

        Args:
            key (str): the semaphore's key.
            by (str | None): who pauses it, for the views; None: ``user@host pid N``.

        Returns:
            bool: whether the key was paused before the call.

        Raises:
            SemaphoreValidationError: ``key`` or ``by`` is invalid (nothing is sent).
            SemaphoreBackendError: Redis failed.
        """
        return self._make(self._pause_trip(key, True, by))

    def resume(self, key: str, by: str | None = None) -> bool:
        """Resume ``key`` for the whole fleet. The free capacity is handed
        to the oldest parked runs in the same script call (published through this admin's
        hand-off route), and callers waiting in ``acquire(wait=...)`` are woken. A live
        limit is left as it is. Who did it
        and when is recorded in Redis and shown by the views; the change is logged. One
        round trip.

        Args:
            key (str): the semaphore's key.
            by (str | None): who resumes it, for the views; None: ``user@host pid N``.

        Returns:
            bool: whether the key was paused before the call.

        Raises:
            SemaphoreValidationError: ``key`` or ``by`` is invalid (nothing is sent).
            SemaphoreBackendError: Redis failed.
        """
        return self._make(self._pause_trip(key, False, by))

    def feedback(self, key: str) -> Feedback | None:
        """What the provider's answers decided for ``key`` (its adaptive limit, its
        cool-down, its back-offs), or None when they decided nothing yet (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(key):
            return feedback_of(self.client.hgetall(self.keys_of(check.check_key(key)).limits))

    def pause_of(self, key: str) -> Pause | None:
        """Whether ``key`` is paused: who paused it and when, or None (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(key):
            return pause_of(self.client.hgetall(self.keys_of(check.check_key(key)).limits))

    def set_rate(
        self, key: str, rate: str | float | Rate | None, *, name: str = "requests",
        by: str | None = None,
    ) -> str | None:  # fmt: skip
        """Set the live start rate ``name`` of ``key``, which wins over the rate of that
        name every caller gives until it is cleared (None clears it); one round trip, logged
        and shown by the views. It changes a rate the callers give (``rate=`` of the task);
        a key whose callers give no rate of that name is not held to it. A run already
        handed an instant keeps it; the next follow the new rate.

        Args:
            key (str): the semaphore's key.
            rate (str | float | Rate | None): ``"300/m"``, a number per second, or a
                :class:`Rate` (for a burst; its own name wins); None to clear.
            name (str): which of the key's rates (default ``"requests"``).
            by (str | None): who sets it, for the views; None: ``user@host pid N``.

        Returns:
            str | None: the live rate it replaced, as given (None: there was none).

        Raises:
            SemaphoreValidationError: an argument is invalid (nothing is sent).
            SemaphoreBackendError: Redis failed.
        """
        return self._make(self._rate_trip(key, rate, name, by))

    def server_warnings(self) -> list[str]:
        """What about the server could break the semaphore's promise, for a start-up log:
        :func:`eviction_warnings`, one sentence a problem (none from a server that refuses
        ``CONFIG GET``, as some managed services do)."""
        try:
            return eviction_warnings(self.client.config_get("maxmemory-policy"))
        except redis.RedisError:
            return []
