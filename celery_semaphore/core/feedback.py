"""Provider feedback: a limit that adapts to a provider's answers (:class:`Adaptive`), and the
back-off a body raises when the provider says it is over its limit (:class:`BackOff`).

What they do in the store (the fleet-wide cool-down, the cut and the growth of the limit)
is written once, in ``lua/adapt.lua``, which release.lua runs with the run's verdict; the
limit that applies is read by every script in ``lua/limit.lua``. BackOff follows BullMQ's
``RateLimitError`` (the queue, not the job, waits out the provider's limit, and the job
keeps its attempts); the growth is additive and the cut multiplicative, as in TCP's AIMD and
Netflix's concurrency-limits, but fleet-wide, with a remembered ceiling (see adapt.lua).
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import SemaphoreValidationError
from . import validation as check

DEFAULT_MAX_COOL_DOWN = 300.0
"""Seconds: the longest cool-down a back-off's hint may ask for (longer ones are clamped)."""


@dataclass(frozen=True)
class Adaptive:
    """A limit the fleet finds for itself from the provider's answers, given as ``limit=``.

    It starts at ``initial``; each back-off halves it (once per cool-down: runs that started
    before the cut and answer 429 too do not cut it again), never below ``min``; runs that
    end well while the key is saturated (every slot held, or runs waiting) raise it by about
    one per ``limit`` of them, never above ``max``. It then holds one below the limit at
    which the last cut came, and goes back to that limit only to probe, every 10 s at first,
    then up to 15 s while probes fail. One value per key, kept in the store and shared by
    every worker; an operator's live limit wins over it, and a pause freezes it. Lost with
    the store (or idle for a day), it starts again from ``initial``.

    Args:
        initial (int): the limit before the store knows better (>= 1).
        min (int): the lowest it goes (>= 1, at most ``initial``).
        max (int): the highest it goes (at least ``initial``); keyword only.

    Raises:
        SemaphoreValidationError: a bound is not an int >= 1, or ``min <= initial <= max``
            does not hold.
    """

    initial: int
    min: int = 1
    max: int = field(kw_only=True)

    def __post_init__(self) -> None:
        for name in ("initial", "min", "max"):
            check.check_limit(getattr(self, name), f"Adaptive {name}")
        if not self.min <= self.initial <= self.max:
            raise SemaphoreValidationError(
                f"Adaptive needs min <= initial <= max, got min={self.min}, "
                f"initial={self.initial}, max={self.max}"
            )

    @property
    def spec(self) -> str:
        """How release.lua is told of it: ``"<initial> <min> <max>"``."""
        return f"{self.initial} {self.min} {self.max}"


def retry_after_seconds(value: object) -> float | None:
    """A Retry-After hint in seconds: ``value`` is None (no hint), a number of seconds >= 0,
    a numeric string, or an HTTP date (RFC 9110; a date past is 0 s).

    Raises:
        SemaphoreValidationError: ``value`` is negative, not finite, or none of these.
    """
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("latin-1")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            try:
                return max(0.0, email.utils.parsedate_to_datetime(text).timestamp() - time.time())
            except (TypeError, ValueError):
                raise SemaphoreValidationError(
                    f"retry_after must be seconds or an HTTP date, got {text!r:.80}"
                ) from None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value >= 0)
    ):
        raise SemaphoreValidationError(
            f"retry_after must be seconds >= 0 or an HTTP date, got {value!r:.80}"
        )
    return float(value)


class BackOff(Exception):
    """Raised from a bounded body: the provider answered that it is over its limit (HTTP 429).

    The key cools down fleet-wide (no slot is given on any worker until the store's now plus
    the hint; with no hint, 1 s, doubled while back-offs follow one another, up to the
    longest cool-down), an :class:`Adaptive` limit is cut, and the run waits again for a
    slot, keeping its place and its ``max_retries`` (see the Celery glue). Bodies already
    running go on.

    Args:
        retry_after (float | int | str | None): the provider's hint, as Retry-After carries
            it: seconds (a number or numeric string) or an HTTP date; None: no hint.
        key (str | None): which of several keys the back-off is about; None: the first.

    Raises:
        SemaphoreValidationError: ``retry_after`` is negative or unreadable.
    """

    def __init__(self, retry_after: object = None, key: str | None = None) -> None:
        super().__init__(retry_after, key)
        self.retry_after = retry_after_seconds(retry_after)
        self.key = key

    def __str__(self) -> str:
        hint = "no hint" if self.retry_after is None else f"retry after {self.retry_after:g}s"
        return f"provider over its limit ({hint})"

    @classmethod
    def from_error(cls, exc: BaseException) -> BackOff:
        """The back-off an exception of a ``back_off_on`` type stands for: its hint is its
        ``retry_after`` attribute, else its ``response.headers["Retry-After"]`` (requests,
        httpx and the openai client carry one), else none. A hint that cannot be read
        counts as none: it came from the provider, not from the code."""
        if isinstance(exc, BackOff):
            return exc
        hint = getattr(exc, "retry_after", None)
        if hint is None:
            headers = getattr(getattr(exc, "response", None), "headers", None)
            hint = headers.get("Retry-After") if isinstance(headers, Mapping) else None
        try:
            return cls(hint)
        except SemaphoreValidationError:
            return cls()


def back_off_types(value: Any) -> tuple[type[BaseException], ...]:
    """The ``back_off_on`` option checked: an exception class or a tuple of them.

    Raises:
        SemaphoreValidationError: an entry is not an exception class.
    """
    types = value if isinstance(value, tuple) else (value,)
    for entry in types:
        if not (isinstance(entry, type) and issubclass(entry, BaseException)):
            raise SemaphoreValidationError(
                f"back_off_on must be exception classes, got {entry!r:.80}"
            )
    return types
