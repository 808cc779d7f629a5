"""Read-only views of every semaphore under a prefix: who holds what, since when, until when.

Redis holds the truth, so every view (the CLI, ``celery inspect semaphores``, the worker's
stats, the Flower page) reads it from there through these functions; that way a slot held
by a worker that died, whose lease has not yet run out, shows up too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import redis

from ..core.admin import DEFAULT_PREFIX, Holder, SemaphoreAdmin
from ..core.room import Waiter


@dataclass(frozen=True)
class SemaphoreView:
    """One semaphore as Redis has it now.

    Attributes:
        key (str): the semaphore's key.
        limit (int | None): the largest limit a live holder was admitted under (holders
            record it), or None when it has no live holder.
        holders (tuple[Holder, ...]): live holders, soonest expiry first. A slot handed to
            a parked run and not yet claimed is a holder whose metadata has
            ``reserved_for`` (the run's task id).
        waiting (tuple[Waiter, ...]): runs parked in the key's waiting room, oldest first.
    """

    key: str
    limit: int | None
    holders: tuple[Holder, ...]
    waiting: tuple[Waiter, ...] = ()

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
        """How many slots are held."""
        return len(self.holders)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: key, limit, in_use, queued, oldest_wait, each holder's fields
        and each parked run's."""
        return {
            "key": self.key,
            "limit": self.limit,
            "in_use": self.in_use,
            "queued": self.queued,
            "oldest_wait": self.oldest_wait,
            "holders": [dict(asdict(h), metadata=dict(h.metadata)) for h in self.holders],
            "waiting": [asdict(w) for w in self.waiting],
        }


def view(client: redis.Redis, key: str, prefix: str = DEFAULT_PREFIX) -> SemaphoreView:
    """The live holders and the waiting room of one semaphore (two round trips).

    Raises:
        SemaphoreValidationError: ``key`` is not a non-empty str.
        SemaphoreBackendError: Redis failed.
    """
    admin = SemaphoreAdmin(client, prefix)
    holders = tuple(admin.holders(key))
    limits = [h.metadata["limit"] for h in holders if isinstance(h.metadata.get("limit"), int)]
    limit = max(limits) if limits else None
    return SemaphoreView(key=key, limit=limit, holders=holders, waiting=tuple(admin.room(key)))


def views(
    client: redis.Redis, keys: Iterable[str] | None = None, prefix: str = DEFAULT_PREFIX
) -> list[SemaphoreView]:
    """A view of each of ``keys``, or of every semaphore under ``prefix`` when None.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    if keys is None:
        admin = SemaphoreAdmin(client, prefix)
        chosen = sorted({*admin.scan_keys(), *admin.scan_keys(rooms=True)})
    else:
        chosen = list(keys)
    return [view(client, key, prefix) for key in chosen]
