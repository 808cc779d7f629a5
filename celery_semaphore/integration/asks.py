"""What one run asks for: a key, its limit and the run's weight, or several such keys held
all at once; and taking it from a :class:`Semaphore` outside the waiting room."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ..core.group import SlotGroup
from ..core.rates import Rate, units_from
from ..core.semaphore import Semaphore
from ..core.slot import Slot
from .keys import KeySet, KeyTemplate
from .limits import HeadStartSpec, LimitSpec, WeightSpec

POLL = 0.1
"""Seconds between two tries of several keys outside a worker (no wake-up list spans keys)."""


class Ask(NamedTuple):
    """One run's ask: ``key`` (the keys joined with ``+`` when there are several, for log
    lines), ``limit`` and ``weight`` (the first key's), ``many``, the ``(key, limit,
    weight)`` of each key when the run holds several, else None; and its place in the
    waiting room: ``tenant``, its tenant for fair turns ("" for none), and ``head_start``,
    seconds it parks ahead of its arrival; ``units``, its units of each start rate whose
    units a callable computes (None: each rate's fixed units)."""

    key: str
    limit: int
    weight: int
    many: list[tuple[str, int, int]] | None = None
    tenant: str = ""
    head_start: float = 0.0
    units: Mapping[str, int] | None = None

    @property
    def keys(self) -> list[str]:
        """Every key the run holds a slot of."""
        return [key for key, _, _ in self.many] if self.many else [self.key]


def ask_for(
    template: KeyTemplate | KeySet,
    limits: LimitSpec,
    weights: WeightSpec,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    fair: KeyTemplate | None = None,
    head_start: HeadStartSpec | None = None,
    rates: Sequence[Rate] = (),
) -> Ask:
    """The ask of a run with these arguments: each key rendered, its limit and the run's
    weight computed.

    Raises:
        SemaphoreValidationError: a key, limit, weight or head start is invalid; the
            message names it.
        Exception: whatever a key, limit, weight, tenant or head start callable raised.
    """
    if isinstance(template, KeySet):
        many = []
        for key, (_, spec) in zip(template.render_each(args, kwargs), template.entries,
                                  strict=True):  # fmt: skip
            limit = spec.for_call(key, args, kwargs)
            many.append((key, limit, weights.for_call(key, limit, args, kwargs)))
        return Ask("+".join(k for k, _, _ in many), many[0][1], many[0][2], many)
    key = template.render(args, kwargs)
    limit = limits.for_call(key, args, kwargs)
    tenant = "" if fair is None else fair.render(args, kwargs)
    ahead = 0.0 if head_start is None else head_start.for_call(args, kwargs)
    units = units_from(rates, args, kwargs) if any(callable(r.units) for r in rates) else None
    return Ask(key, limit, weights.for_call(key, limit, args, kwargs), None, tenant, ahead,
               units)  # fmt: skip


def take(
    semaphore: Semaphore,
    ask: Ask,
    *,
    metadata: Mapping[str, Any] | None = None,
    wait: float = 0.0,
    retries: int = 0,
    retry_delay: float = 0.1,
) -> Slot | SlotGroup | None:
    """Take what ``ask`` asks for: a slot, or the slots of several keys at once (tried
    every :data:`POLL` seconds while ``wait`` lasts, as no release wakes a waiter across
    keys); None when it is not to be had.

    Raises:
        SemaphoreValidationError: an argument is invalid.
        SemaphoreBackendError: Redis failed.
    """
    if ask.many:
        if wait:
            retries, retry_delay = max(retries, math.ceil(wait / POLL)), POLL
        return semaphore.acquire_many(
            ask.many, metadata=metadata, retries=retries, retry_delay=retry_delay
        )
    return semaphore.acquire(
        ask.key, limit=ask.limit, weight=ask.weight, metadata=metadata,
        retries=0 if wait else retries, retry_delay=retry_delay, wait=wait, units=ask.units,
    )  # fmt: skip
