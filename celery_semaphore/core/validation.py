"""Argument checks shared by the semaphore and the Celery glue, and the waiting room's
(a park's or claim's) own.

Each check raises :class:`~celery_semaphore.errors.SemaphoreValidationError` naming the
argument, so a caller sees which option is wrong before anything is written to Redis.
"""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from ..errors import SemaphoreValidationError

MAX_SECONDS = 366 * 24 * 3600.0
"""Longest duration any option accepts (a year). Far longer values overflow Redis expiry
times, thread waits or Celery ETAs, and are never what was meant."""


def _finite_seconds(value: object) -> float | None:
    """``value`` as float seconds if it is a finite int or float within a year, else None."""
    # bool is an int subclass; True as a lease or a delay is always a mistake.
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return seconds if math.isfinite(seconds) and abs(seconds) <= MAX_SECONDS else None


def check_key(key: object, name: str = "key") -> str:
    """Return ``key`` as a plain str if it is a non-empty str that UTF-8 can encode in at most
    ``MAX_KEY_BYTES`` bytes, else raise (a str subclass is reduced to its characters, so it
    names one Redis key)."""
    if not isinstance(key, str) or not key:
        raise SemaphoreValidationError(f"{name} must be a non-empty str, got {key!r}")
    plain = str.__str__(key)
    try:
        size = len(plain.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise SemaphoreValidationError(f"{name} must be valid Unicode text: {exc}") from None
    if size > MAX_KEY_BYTES:
        raise SemaphoreValidationError(
            f"{name} must be at most {MAX_KEY_BYTES} bytes of UTF-8, got {size}: {plain:.40}…"
        )
    return plain


MAX_LIMIT = 2**31 - 1
"""Largest limit: the scripts hold numbers as doubles, and no real pool is larger."""

MAX_KEY_BYTES = 4096
"""Longest key, in UTF-8 bytes: a key is part of every Redis key name and log line."""


def check_limit(limit: object, name: str = "limit") -> int:
    """Return ``limit`` as a plain int if it is an int from 1 to ``MAX_LIMIT`` (bool
    excluded), else raise. An int subclass (an ``IntEnum``, say) becomes a plain int, which
    redis-py sends as digits rather than as its ``repr``."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise SemaphoreValidationError(
            f"{name} must be an int from 1 to {MAX_LIMIT}, got {limit!r:.60}"
        )
    return int(limit)


def check_weight(weight: object, limit: int, name: str = "weight") -> int:
    """Return ``weight`` if it is an int from 1 to ``limit`` (bool excluded), else raise: a
    run that takes more units than the limit could never be admitted."""
    if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= limit:
        raise SemaphoreValidationError(
            f"{name} must be an int from 1 to the limit ({limit}), got {weight!r}", None, limit
        )
    return int(weight)


def lease_ms(lease: object, name: str = "lease") -> int:
    """Convert a lease in float seconds to whole milliseconds, the unit Redis scores use.

    Raises:
        SemaphoreValidationError: ``lease`` is not a finite number > 0, or rounds to 0 ms.
    """
    seconds = _finite_seconds(lease)
    if seconds is None or seconds <= 0:
        raise SemaphoreValidationError(
            f"{name} must be a number of seconds > 0 and at most {MAX_SECONDS:g}, got {lease!r}"
        )
    ms = round(seconds * 1000)
    if ms < 1:
        raise SemaphoreValidationError(f"{name} must be at least 0.001 seconds, got {lease!r}")
    return ms


def check_retries(retries: object, name: str = "retries") -> int:
    """Return ``retries`` as a plain int if it is an int >= 0 (bool excluded), else raise."""
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise SemaphoreValidationError(f"{name} must be an int >= 0, got {retries!r}")
    return int(retries)


def check_delay(delay: object, name: str = "retry_delay") -> float:
    """Return ``delay`` as float seconds if it is a finite number >= 0, else raise."""
    seconds = _finite_seconds(delay)
    if seconds is None or seconds < 0:
        raise SemaphoreValidationError(
            f"{name} must be a number of seconds >= 0 and at most {MAX_SECONDS:g}, got {delay!r}"
        )
    return seconds


def room_limit(limit: int | None, default: int | None) -> int:
    """A park's limit: ``limit`` checked, else the room's ``default``.

    Raises:
        SemaphoreValidationError: ``limit`` is invalid, or both are None.
    """
    if limit is not None:
        return check_limit(limit)
    if default is None:
        raise SemaphoreValidationError("limit is required: this room has no default limit")
    return default


MAX_HEAD_START = 24 * 3600.0
"""Longest head start a parked waiter may be given (a day): a waiter with none is passed
only by those that came less than this long after it, so this bounds how long it can be
passed over."""


def head_start_ms(value: object, name: str = "head_start") -> int:
    """Return a head start, float seconds from 0 to ``MAX_HEAD_START``, in whole ms, else
    raise :class:`SemaphoreValidationError` naming ``name``."""
    seconds = _finite_seconds(value)
    if seconds is None or not 0 <= seconds <= MAX_HEAD_START:
        raise SemaphoreValidationError(
            f"{name} must be a number of seconds from 0 to {MAX_HEAD_START:g}, got {value!r}"
        )
    return round(seconds * 1000)


MAX_EPOCH = 4_102_444_800.0
"""Latest timestamp any argument accepts (2100-01-01): later ones are never what was meant."""


def check_epoch(value: object, name: str) -> float:
    """Return ``value`` as float epoch seconds if it is a finite number from 0 to
    ``MAX_EPOCH`` (bool excluded), else raise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
        if math.isfinite(seconds) and 0 <= seconds <= MAX_EPOCH:
            return seconds
    raise SemaphoreValidationError(f"{name} must be epoch seconds from 0 to 2100, got {value!r}")


def heartbeat_interval(heartbeat: object, lease: float, name: str = "heartbeat") -> float | None:
    """Resolve the renewal interval in float seconds, or ``None`` when renewal is off.

    ``None`` means the default, a quarter of the lease (at least 1 ms): three renewals in a
    row may fail before the slot could lapse. ``False`` turns renewal off. An explicit value
    must be at most half the lease, since a longer interval lets the first tick arrive at or
    after expiry (the rule and the quarter default come from the leased-semaphore spec).

    Raises:
        SemaphoreValidationError: ``heartbeat`` is not None/False/a finite number > 0, or
            is above ``lease / 2``.
    """
    if heartbeat is None:
        return max(0.001, lease / 4)
    if heartbeat is False:
        return None
    seconds = _finite_seconds(heartbeat)
    if seconds is None or seconds <= 0:
        raise SemaphoreValidationError(
            f"{name} must be None, False or a finite number of seconds > 0, got {heartbeat!r}"
        )
    if seconds > lease / 2:
        raise SemaphoreValidationError(
            f"{name} must be at most half of lease ({lease / 2:g}s), got {heartbeat!r}"
        )
    return seconds


def check_flag(value: object, name: str) -> bool:
    """``value`` if it is True or False.

    Raises:
        SemaphoreValidationError: ``value`` is anything else (a 1, a "yes").
    """
    if not isinstance(value, bool):
        raise SemaphoreValidationError(f"{name} must be True or False, got {value!r}")
    return value


def check_callback(callback: object, name: str) -> Callable[..., Any] | None:
    """Return ``callback`` if it is None or callable, else raise."""
    if callback is not None and not callable(callback):
        raise SemaphoreValidationError(f"{name} must be callable or None, got {callback!r}")
    return callback


def unknown_option(name: str, known: Collection[str]) -> SemaphoreValidationError:
    """The error for an option ``name`` that is not one of ``known``, with the closest match
    (by :func:`difflib.get_close_matches`) as a hint; a ``semaphore_*`` spelling of a task
    option (the app setting's name) is pointed at the option."""
    bare = name.removeprefix("semaphore_")
    close = [bare] if bare in known else difflib.get_close_matches(bare, known, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]!r}?)" if close else f"; known options: {sorted(known)}"
    return SemaphoreValidationError(f"unknown semaphore option {name!r}{hint}")


R = TypeVar("R")


def memoised(check: Callable[..., R], size: int = 256) -> Callable[..., R]:
    """``check(*args)``, run once per distinct arguments (:func:`functools.lru_cache`, at
    most ``size`` of them): callers pass the same few options again and again, and the
    checks cost more than the rest of an acquire's client side.

    The arguments' types are part of the memo (``typed``), so ``True`` is never taken for a
    valid ``1``; a check that raises keeps nothing, and unhashable arguments (which the
    checks refuse) are checked each time.

    Args:
        check (Callable[..., R]): the check; it raises on invalid arguments or returns what
            the caller needs of valid ones.
        size (int): how many distinct arguments to keep.
    """
    cached = functools.lru_cache(maxsize=size, typed=True)(check)

    def checked(*args: Any) -> R:
        try:
            return cached(*args)
        except TypeError:  # an unhashable argument has no memo
            return check(*args)

    return checked


def check_waiter(waiter: object, payload: object) -> None:
    """Refuse a waiter id the room cannot tell apart from its own marks, or a payload that is
    not bytes.

    Raises:
        SemaphoreValidationError: ``waiter`` is empty, starts with ``~`` or ``!`` or holds a
            ``#``, or ``payload`` is not bytes.
    """
    waiter = check_key(waiter, "waiter")
    if waiter[0] in "~!" or "#" in waiter:
        raise SemaphoreValidationError(
            f"waiter must not start with ~ or ! nor contain #, got {waiter!r}"
        )
    if not isinstance(payload, bytes):
        raise SemaphoreValidationError(f"payload must be bytes, got {type(payload).__name__}")


def park_args(
    lease: float | None, default_lease: float, arrival: float | None, max_queued: int,
    room_ttl: float, waited: float | None = None,
) -> tuple[float, int, int | None, int, int]:  # fmt: skip
    """The lease (seconds and ms), arrival (epoch ms; a negative number is a wait, in ms
    before the server's now, from ``waited``), room size and room TTL (ms) of a park or
    claim, checked.

    Raises:
        SemaphoreValidationError: one of them is invalid, or both ``arrival`` and
            ``waited`` are given; the message names it.
    """
    arrival_ms = None if arrival is None else round(check_epoch(arrival, "arrival") * 1000)
    if waited is not None:
        if arrival is not None:
            raise SemaphoreValidationError("give park() arrival or waited, not both")
        waited_ms = round(check_delay(waited, "waited") * 1000)
        arrival_ms = -waited_ms if waited_ms else None
    seconds, ms, queued, ttl_ms = _park_timing(lease, default_lease, max_queued, room_ttl)
    return seconds, ms, arrival_ms, queued, ttl_ms


def check_delivery(delivery: object) -> None:
    """Refuse a claim's ``delivery`` id that is neither "" nor a non-empty str.

    Raises:
        SemaphoreValidationError: it is not a str.
    """
    if delivery != "":
        check_key(delivery, "delivery")


def deadline_ms(deadline: float | None, budget: float | None) -> int:
    """A park's give-up time for park.lua: 0 for none, epoch ms from ``deadline``, or a
    negative number, ``budget`` seconds in ms, which the server counts from the waiter's
    arrival on its own clock.

    Raises:
        SemaphoreValidationError: ``deadline`` is not epoch seconds, ``budget`` is not a
            positive number of seconds, or both are given.
    """
    if budget is not None:
        if deadline is not None:
            raise SemaphoreValidationError("give park() deadline or budget, not both")
        return -lease_ms(budget, "budget")
    return 0 if deadline is None else round(check_epoch(deadline, "deadline") * 1000)


def _check_park_timing(
    lease: float | None, default_lease: float, max_queued: int, room_ttl: float
) -> tuple[float, int, int, int]:
    seconds = default_lease if lease is None else lease
    return (float(seconds), lease_ms(seconds), check_retries(max_queued, "max_queued"),
            lease_ms(room_ttl, "room_ttl"))  # fmt: skip


_park_timing = memoised(_check_park_timing)
"""A park's lease, room size and room TTL checked, once per distinct value."""
