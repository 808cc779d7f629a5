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

from ..core.admin import DEFAULT_PREFIX, Holder, LiveLimit, SemaphoreAdmin
from ..core.room import Waiter


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
    """

    key: str
    limit: int | None
    holders: tuple[Holder, ...]
    waiting: tuple[Waiter, ...] = ()
    live: LiveLimit | None = None
    declared: int | None = None

    @property
    def queued(self) -> int:
        """How many runs are parked in the waiting room."""
        return len(self.waiting)

    @property
    def oldest_wait(self) -> float | None:
        """Seconds the oldest parked run has waited, or None when none is parked."""
        return self.waiting[0].waited if self.waiting else None

    @property
    def in_use(self) -> int:
        """How many units of the limit are held: one per holder, or its weight."""
        return sum(_weight(h) for h in self.holders)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: key, limit, live_limit (limit, set_at, by; or None),
        declared_limit, in_use, queued, oldest_wait, each holder's fields and each parked
        run's."""
        return {
            "key": self.key,
            "limit": self.limit,
            "live_limit": None if self.live is None else asdict(self.live),
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


def view(
    client: redis.Redis, key: str, prefix: str = DEFAULT_PREFIX, declared: int | None = None
) -> SemaphoreView:
    """The live holders, the waiting room and the live limit of one semaphore (three round
    trips); ``declared`` is its limit in ``app.conf.semaphores``, if any.

    Raises:
        SemaphoreValidationError: ``key`` is not a non-empty str.
        SemaphoreBackendError: Redis failed.
    """
    admin = SemaphoreAdmin(client, prefix)
    holders = tuple(admin.holders(key))
    live = admin.live_limit(key)
    limits = [h.metadata["limit"] for h in holders if isinstance(h.metadata.get("limit"), int)]
    limit = live.limit if live else max(limits) if limits else declared
    return SemaphoreView(key=key, limit=limit, holders=holders, waiting=tuple(admin.room(key)),
                         live=live, declared=declared)  # fmt: skip


def views(
    client: redis.Redis,
    keys: Iterable[str] | None = None,
    prefix: str = DEFAULT_PREFIX,
    declared: Mapping[str, int] | None = None,
) -> list[SemaphoreView]:
    """A view of each of ``keys``, or of every semaphore under ``prefix`` when None, plus
    every key ``declared`` names (``app.conf.semaphores``' fixed limits by key), busy or not.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    declared = declared or {}
    if keys is None:
        admin = SemaphoreAdmin(client, prefix)
        found = {*admin.scan_keys(), *admin.scan_keys(rooms=True), *admin.scan_keys(limits=True)}
        chosen = sorted(found | set(declared))
    else:
        chosen = list(keys)
    return [view(client, key, prefix, declared.get(key)) for key in chosen]
