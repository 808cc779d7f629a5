"""Read-only views of every semaphore under a prefix: who holds what, since when, until when.

Redis holds the truth, so every view (the CLI, ``celery inspect semaphores``, the worker's
stats, the Flower page) reads it from there through these functions; that way a slot held
by a worker that died, whose lease has not yet run out, shows up too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import redis

from ..core import validation as check
from ..core.admin import DEFAULT_PREFIX, Holder, LiveLimit, SemaphoreAdmin
from ..core.calls import waiting_call
from ..core.live import (
    Feedback,
    Pause,
    RateState,
    feedback_of,
    live_limit_of,
    pause_of,
    read_rate_states,
)
from ..core.names import Namespace
from ..core.replies import Waiter
from ..core.room import WaitingRoom
from ..core.scripts import Scripts, backend_errors
from ..errors import SemaphoreValidationError

MAX_PAGE = 1000
"""The most rows one page of a waiting room may ask for."""


@dataclass(frozen=True)
class SemaphoreView:
    """One semaphore as Redis has it now.

    Attributes:
        key (str): the semaphore's key.
        limit (int | None): the limit in force: the live limit if one is set, else the
            largest limit a live holder was admitted under (holders record it), else the
            limit ``app.conf.semaphores`` declares; None when none of these is known.
        holders (tuple[Holder, ...]): live holders, soonest expiry first. A slot handed to
            a parked run and not yet claimed is a holder whose metadata has
            ``reserved_for`` (the run's task id).
        waiting (tuple[Waiter, ...]): runs parked in the key's waiting room, oldest first.
        live (LiveLimit | None): the live limit set on the key in Redis, with who set it and
            when (``celery semaphore set-limit``), or None.
        declared (int | None): the limit ``app.conf.semaphores`` declares for the key.
        waiting_total (int | None): how many runs are parked, when ``waiting`` lists only
            the first of them; None when it lists them all.
        paused (Pause | None): who paused the key and when (``celery semaphore pause``),
            or None when it is not paused.
        rates (tuple[RateState, ...]): the key's start rates: units free now, when the
            next falls due, and a live rate with who set it (``celery semaphore set-rate``).
        feedback (Feedback | None): what the provider's answers decided: the adaptive limit
            with its bounds, the cool-down's end, the back-offs and the last one.
    """

    key: str
    limit: int | None
    holders: tuple[Holder, ...]
    waiting: tuple[Waiter, ...] = ()
    live: LiveLimit | None = None
    declared: int | None = None
    waiting_total: int | None = None
    paused: Pause | None = None
    rates: tuple[RateState, ...] = ()
    feedback: Feedback | None = None

    @property
    def queued(self) -> int:
        """How many runs are parked in the waiting room."""
        return len(self.waiting) if self.waiting_total is None else self.waiting_total

    @property
    def oldest_wait(self) -> float | None:
        """Seconds the oldest parked run has waited, or None when none is parked."""
        return self.waiting[0].waited if self.waiting else None

    @property
    def in_use(self) -> int:
        """How many units of the limit are held: one per holder, or its weight."""
        return sum(_weight(h) for h in self.holders)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: key, limit, live_limit (limit, set_at, by; or None), paused
        (paused_at, by; or None), rates (each :class:`RateState`), feedback (a
        :class:`~celery_semaphore.core.live.Feedback`, or None), declared_limit, in_use,
        queued, oldest_wait, each holder's fields and each parked run's."""
        return {
            "key": self.key,
            "limit": self.limit,
            "live_limit": None if self.live is None else asdict(self.live),
            "paused": None if self.paused is None else asdict(self.paused),
            "rates": [asdict(rate) for rate in self.rates],
            "feedback": None if self.feedback is None else asdict(self.feedback),
            "declared_limit": self.declared,
            "in_use": self.in_use,
            "queued": self.queued,
            "oldest_wait": self.oldest_wait,
            "holders": [dict(asdict(h), metadata=dict(h.metadata)) for h in self.holders],
            "waiting": [asdict(w) for w in self.waiting],
        }


def _weight(holder: Holder) -> int:
    weight = holder.metadata.get("weight", 1)
    return weight if isinstance(weight, int) and weight > 0 else 1


@dataclass(frozen=True)
class WaitingPage:
    """One page of a key's waiting room, first served first.

    Attributes:
        key (str): the semaphore's key.
        total (int): how many runs are parked in all.
        offset (int): how many of them come before this page.
        limit (int): how many the page was asked for (it holds fewer at the end).
        waiting (tuple[Waiter, ...]): the page's runs.
    """

    key: str
    total: int
    offset: int
    limit: int
    waiting: tuple[Waiter, ...]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: key, total, offset, limit and each parked run's fields."""
        return {"key": self.key, "total": self.total, "offset": self.offset,
                "limit": self.limit, "waiting": [asdict(w) for w in self.waiting]}  # fmt: skip


def check_page(offset: object, limit: object) -> tuple[int, int]:
    """``offset`` (an int >= 0) and ``limit`` (an int from 1 to :data:`MAX_PAGE`), checked.

    Raises:
        SemaphoreValidationError: either is out of range or not an int.
    """
    first = check.check_retries(offset, "offset")
    rows = check.check_limit(limit, "limit")
    if rows > MAX_PAGE:
        raise SemaphoreValidationError(f"limit must be at most {MAX_PAGE}, got {rows}")
    return first, rows


def waiting_page(
    client: redis.Redis, key: str, prefix: str = DEFAULT_PREFIX, offset: int = 0,
    limit: int = 100,
) -> WaitingPage:  # fmt: skip
    """The runs parked on ``key`` from the ``offset``-th, at most ``limit`` of them, and how
    many are parked in all (one read-only round trip, whatever the room's size).

    Raises:
        SemaphoreValidationError: ``key``, ``offset`` or ``limit`` is invalid (see
            :func:`check_page`); nothing is sent.
        SemaphoreBackendError: Redis failed.
    """
    first, rows = check_page(offset, limit)
    keys = Namespace(prefix, isinstance(client, redis.RedisCluster)).keys_of(check.check_key(key))
    with backend_errors(key):
        now_ms, total, found = Scripts(client).run(waiting_call(keys, first + rows - 1, first))
    waiting = tuple(Waiter(w, arrival / 1000, (now_ms - arrival) / 1000) for w, arrival in found)
    return WaitingPage(key, total, first, rows, waiting)


def view(
    client: redis.Redis, key: str, prefix: str = DEFAULT_PREFIX, declared: int | None = None,
    waiting: int | None = None,
) -> SemaphoreView:  # fmt: skip
    """The live holders, the waiting room, and the live limit and pause of one semaphore
    (three round trips); ``declared`` is its limit in ``app.conf.semaphores``, if any.
    ``waiting`` lists at most that many parked runs (the first served), with their total;
    None lists them all.

    Raises:
        SemaphoreValidationError: ``key`` or ``waiting`` is invalid.
        SemaphoreBackendError: Redis failed.
    """
    admin = SemaphoreAdmin(client, prefix)
    holders = tuple(admin.holders(key))
    with backend_errors(key):
        raw = client.hgetall(admin.keys_of(key).limits)
        rates = read_rate_states(client, admin.keys_of(key), raw)
    live, paused, feedback = live_limit_of(raw), pause_of(raw), feedback_of(raw)
    limits = [h.metadata["limit"] for h in holders if isinstance(h.metadata.get("limit"), int)]
    given = max(limits) if limits else declared
    limit = live.limit if live else feedback.limit if feedback and feedback.limit else given
    if waiting is None:
        parked, total = tuple(WaitingRoom(client, prefix).waiters(key)), None
    else:
        page = waiting_page(client, key, prefix, 0, waiting)
        parked, total = page.waiting, page.total
    return SemaphoreView(key=key, limit=limit, holders=holders, waiting=parked, live=live,
                         declared=declared, waiting_total=total, paused=paused,
                         rates=rates, feedback=feedback)  # fmt: skip


def semaphore_keys(
    client: redis.Redis, prefix: str = DEFAULT_PREFIX, declared: Iterable[str] = ()
) -> list[str]:
    """Every key under ``prefix`` with a holder, a waiting room or a live limit, and every
    key of ``declared``, sorted.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    admin = SemaphoreAdmin(client, prefix)
    return sorted({*admin.scan_keys(), *admin.scan_keys(rooms=True),
                   *admin.scan_keys(limits=True), *declared})  # fmt: skip


def views(
    client: redis.Redis,
    keys: Iterable[str] | None = None,
    prefix: str = DEFAULT_PREFIX,
    declared: Mapping[str, int] | None = None,
    waiting: int | None = None,
) -> list[SemaphoreView]:
    """A view of each of ``keys``, or of every semaphore under ``prefix`` when None, plus
    every key ``declared`` names (``app.conf.semaphores``' fixed limits by key), busy or not;
    ``waiting`` as for :func:`view`.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    declared = declared or {}
    chosen = semaphore_keys(client, prefix, declared) if keys is None else list(keys)
    return [view(client, key, prefix, declared.get(key), waiting) for key in chosen]
