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


@dataclass(frozen=True)
class SemaphoreView:
    """One semaphore as Redis has it now.

    Attributes:
        key (str): the semaphore's key.
        limit (int | None): the largest limit a live holder was admitted under (holders
            record it), or None when it has no live holder.
        holders (tuple[Holder, ...]): live holders, soonest expiry first.
    """

    key: str
    limit: int | None
    holders: tuple[Holder, ...]

    @property
    def in_use(self) -> int:
        """How many slots are held."""
        return len(self.holders)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: key, limit, in_use and each holder's fields."""
        return {
            "key": self.key,
            "limit": self.limit,
            "in_use": self.in_use,
            "holders": [dict(asdict(h), metadata=dict(h.metadata)) for h in self.holders],
        }


def view(client: redis.Redis, key: str, prefix: str = DEFAULT_PREFIX) -> SemaphoreView:
    """The live holders of one semaphore (one round trip).

    Raises:
        SemaphoreValidationError: ``key`` is not a non-empty str.
        SemaphoreBackendError: Redis failed.
    """
    holders = tuple(SemaphoreAdmin(client, prefix).holders(key))
    limits = [h.metadata["limit"] for h in holders if isinstance(h.metadata.get("limit"), int)]
    return SemaphoreView(key=key, limit=max(limits) if limits else None, holders=holders)


def views(
    client: redis.Redis, keys: Iterable[str] | None = None, prefix: str = DEFAULT_PREFIX
) -> list[SemaphoreView]:
    """A view of each of ``keys``, or of every semaphore under ``prefix`` when None.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    chosen = SemaphoreAdmin(client, prefix).scan_keys() if keys is None else list(keys)
    return [view(client, key, prefix) for key in chosen]
