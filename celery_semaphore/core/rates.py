"""Start rates: how many runs (or units: tokens) of a key may *start* per second, minute,
hour or day across the whole fleet, beside how many may run at once.

A rate is checked and taken in the same script call as the slot (``lua/rates.lua``), on the
Redis server's clock, with GCRA: one number per rate, no refill step, and the instant of the
next allowed start known in advance, which is what lets a waiting room hand a run its slot
for that instant instead of retrying. The spelling follows Celery's ``rate_limit``
(``"10/s"``, ``"500/m"``, ``"1000/h"``; a bare number is per second), and so does the default
burst of 1 (evenly spaced starts); give ``burst`` to let that many start at once after an
idle spell.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SemaphoreValidationError

PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
"""Seconds per unit of a rate's spelling, as Celery's ``rate_limit`` (plus ``d``)."""
_SPELLING = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:/\s*([smhd]))?\s*$")
_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")
MAX_BURST = 10**9


@dataclass(frozen=True)
class Rate:
    """A start rate of a key: ``count`` units per ``period`` seconds, fleet-wide.

    Args:
        spec (str | float): ``"<count>/<s|m|h|d>"`` (``"500/m"``), or a number of units
            per second, as Celery's ``rate_limit`` is spelt.
        burst (int): units that may start at once after an idle spell (>= 1). Default 1:
            starts evenly spaced, one every ``period / count`` seconds. Over any span of
            T seconds at most ``burst + T * count / period`` units start.
        name (str): what the rate counts (letters, digits, ``_``), so that a key can carry
            two: ``"requests"`` (the default) and ``"tokens"``, say.
        units (int | Callable[..., int]): units of this rate one run takes (1 to
            ``burst``), or a callable of the task's arguments returning them (tokens per
            run): the Celery glue's; in the core, pass ``units=`` to the call.

    Raises:
        SemaphoreValidationError: the spelling is not one of the above, the count is not
            positive, or ``burst``, ``name`` or a fixed ``units`` is invalid.
    """

    spec: str | float
    burst: int = 1
    name: str = "requests"
    units: int | Callable[..., int] = 1

    def __post_init__(self) -> None:
        parse_rate(self.spec)
        if (
            isinstance(self.burst, bool)
            or not isinstance(self.burst, int)
            or not (1 <= self.burst <= MAX_BURST)
        ):
            raise SemaphoreValidationError(
                f"rate {self.spec!r}: burst must be an int from 1 to {MAX_BURST}, "
                f"got {self.burst!r}"
            )
        check_rate_name(self.name, f"rate {self.spec!r}: ")
        if not callable(self.units):
            check_units(self, self.units)

    @functools.cached_property
    def interval_ms(self) -> float:
        """Milliseconds per unit: one unit starts every this long at the rate."""
        count, period = parse_rate(self.spec)
        return period * 1000.0 / count

    def lua(self) -> str:
        """The rate as rates.lua reads it: ``"<name> <interval_ms> <burst>"``."""
        return f"{self.name} {self.interval_ms:.6f} {self.burst}"


def check_rate_name(name: object, where: str = "") -> str:
    """``name`` if it names a rate (1 to 64 letters, digits or ``_``), else raise
    :class:`SemaphoreValidationError`, its message starting with ``where``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise SemaphoreValidationError(
            f"{where}name must be 1 to 64 letters, digits or '_', got {name!r}"
        )
    return name


def parse_rate(spec: object, name: str = "rate") -> tuple[float, float]:
    """``(count, period seconds)`` of a rate's spelling.

    Raises:
        SemaphoreValidationError: not ``"<count>/<s|m|h|d>"`` or a number, or a count that
            is not a positive finite number; the message names ``name``.
    """
    found = _SPELLING.match(spec) if isinstance(spec, str) else None
    if found is not None:
        count, period = float(found.group(1)), PERIODS[found.group(2) or "s"]
    elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
        count, period = float(spec), 1.0
    else:
        raise SemaphoreValidationError(
            f"{name} must be like '10/s', '500/m', '1000/h' or '5000/d', got {spec!r}"
        )
    if not math.isfinite(count) or count <= 0 or period * 1000.0 / count > 366 * 86400e3:
        raise SemaphoreValidationError(
            f"{name} must allow more than nothing (a positive count, at least one a year), "
            f"got {spec!r}"
        )
    return count, period


def check_units(rate: Rate, units: object) -> int:
    """``units`` of ``rate`` one run takes, checked: an int from 1 to the rate's burst.

    Raises:
        SemaphoreValidationError: it is not, so the run could never start.
    """
    if isinstance(units, bool) or not isinstance(units, int) or not 1 <= units <= rate.burst:
        raise SemaphoreValidationError(
            f"rate {rate.name!r} ({rate.spec}): a run's units must be an int from 1 to the "
            f"burst, {rate.burst} (more could never start), got {units!r}"
        )
    return units


RateSpec = str | float | Rate | Sequence[str | float | Rate] | None
"""What a ``rate`` option takes: one rate (a spelling or a :class:`Rate`), several, or None."""


def rates_of(spec: object) -> tuple[Rate, ...]:
    """The rates of a ``rate`` option, checked: a spelling stands for ``Rate(spelling)``.

    Raises:
        SemaphoreValidationError: a rate is invalid, or two share a name.
    """
    if spec is None:
        return ()
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    rates = tuple(item if isinstance(item, Rate) else Rate(item) for item in items)  # type: ignore[arg-type]
    names = [rate.name for rate in rates]
    if len(set(names)) != len(names):
        raise SemaphoreValidationError(
            f"each rate of a key needs a name of its own (Rate(..., name='tokens')), got {names}"
        )
    return rates


def units_for(rates: Sequence[Rate], units: Mapping[str, int] | None) -> dict[str, int]:
    """Each rate's units for one run: ``units[name]``, else the rate's fixed units, checked.

    Raises:
        SemaphoreValidationError: a unit count is invalid, or names no rate of the key (or
            units are given and the key has no rate).
    """
    given = dict(units or {})
    if given and not rates:
        raise SemaphoreValidationError(f"units given for no rate: {given}")
    unknown = sorted(set(given) - {rate.name for rate in rates})
    if unknown:
        raise SemaphoreValidationError(f"units for no rate of the key: {unknown}")
    fixed = {r.name: 1 if callable(r.units) else r.units for r in rates}  # a callable's: 1
    return {r.name: check_units(r, given.get(r.name, fixed[r.name])) for r in rates}


def units_from(
    rates: Sequence[Rate], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, int]:
    """Each rate's units for a run with these arguments (a callable ``units`` is called).

    Raises:
        SemaphoreValidationError: a callable's answer is invalid.
        Exception: whatever a callable raised.
    """
    return units_for(rates, {r.name: r.units(*args, **kwargs) for r in rates if callable(r.units)})


def acquire_rates(rates: Sequence[Rate], units: Mapping[str, int] | None) -> tuple[str | int, ...]:
    """acquire.lua's rate arguments: the count, then each rate's name, interval, burst and
    this call's units, checked (``()`` for no rate).

    Raises:
        SemaphoreValidationError: a unit count is invalid.
    """
    found = units_for(rates, units)
    if not rates:
        return ()
    return (
        len(rates),
        *[item for r in rates for item in (r.name, f"{r.interval_ms:.6f}", r.burst, found[r.name])],
    )


def rated(spec: object, units: Mapping[str, int] | None) -> tuple[str, str]:
    """park.lua's rate arguments for a ``rate`` option and a run's ``units``, checked: the
    key's rates and the run's units that are not 1 (``("", "")`` for none).

    Raises:
        SemaphoreValidationError: a rate or a unit count is invalid.
    """
    found = units_for(rates := rates_of(spec), units)
    return (" ".join(rate.lua() for rate in rates),
            ",".join(f"{name}={u}" for name, u in found.items() if u != 1))  # fmt: skip


def refuse_for_many(rates: Sequence[Rate]) -> None:
    """Refuse ``acquire_many`` on a semaphore with start rates: the several-keys script
    takes slots only, and a rate it skipped would let those calls pass it unseen.

    Raises:
        SemaphoreValidationError: ``rates`` is not empty.
    """
    if rates:
        raise SemaphoreValidationError(
            "acquire_many takes no start rates: this semaphore has "
            f"{', '.join(repr(r.spec) for r in rates)}; take rated keys one at a time "
            "(acquire), or use a semaphore without rate= for the several keys"
        )
