"""What an operator sets live, in Redis, for every caller of a key until it is cleared: a
live limit, which wins over the limit its callers give; a pause, which makes that limit 0
until it is resumed (``set_limit.lua``); and a live start rate, which wins over the rate of
the same name the callers give (``set_rate.lua``; see :mod:`.rates`). What the sync and
asyncio admins and the views share about them: the records, reading them (and the state of
a key's rates) from a key's limits hash, who makes a change, the rate's script call, and
logging a change; a change is checked and decided by
:class:`~celery_semaphore.core.admin.AdminTrips`, and the round trips are
:meth:`SemaphoreAdmin.set_limit <celery_semaphore.core.admin.SemaphoreAdmin.set_limit>` (and
``pause``, ``set_rate``) and their asyncio twins'."""

from __future__ import annotations

import getpass
import json
import logging
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import validation as check
from .calls import Call, call_of
from .names import Keys
from .rates import Rate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveLimit:
    """A key's live limit: set in Redis by an operator, it wins over the limit in the code
    until it is cleared (see :meth:`SemaphoreAdmin.set_limit`).

    Attributes:
        limit (int): the limit.
        set_at (float): when it was set, epoch seconds by the Redis clock.
        by (str): who set it (``user@host pid N`` unless the setter said otherwise).
    """

    limit: int
    set_at: float
    by: str


@dataclass(frozen=True)
class Pause:
    """A key an operator paused: nothing new starts on it until it is resumed (see
    :meth:`SemaphoreAdmin.pause`).

    Attributes:
        paused_at (float): when it was paused, epoch seconds by the Redis clock.
        by (str): who paused it (``user@host pid N`` unless the pauser said otherwise).
    """

    paused_at: float
    by: str


@dataclass(frozen=True)
class Feedback:
    """What the provider's answers decided for a key (see
    :class:`~celery_semaphore.core.feedback.BackOff` and
    :class:`~celery_semaphore.core.feedback.Adaptive`).

    Attributes:
        limit (int | None): the adaptive limit now; None: the key's limit is not adaptive
            (or no run of it has ended since the store last lost its state).
        min (int | None): its lowest value; max (int | None): its highest.
        cooling_until (float): when the last cool-down ends or ended (epoch seconds, Redis
            clock); 0.0: no back-off yet.
        back_offs (int): back-offs so far (while the state lasts).
        last_by (str): who backed off last (``host:pid``); last_at (float): when (epoch
            seconds); last_hint (float | None): the cool-down it asked for (seconds).
    """

    limit: int | None
    min: int | None
    max: int | None
    cooling_until: float
    back_offs: int
    last_by: str
    last_at: float
    last_hint: float | None

    def cooling(self, now: float) -> bool:
        """Whether the key is cooling down at ``now`` (epoch seconds, Redis clock)."""
        return self.cooling_until > now


def feedback_of(raw: Mapping[Any, Any]) -> Feedback | None:
    """The provider's state a key's limits hash holds (adapt.lua's fields), read from
    HGETALL's reply (bytes or text), or None when it holds none."""
    fields = {text_of(k): text_of(v) for k, v in raw.items()}
    if "a:limit" not in fields and "cool:until" not in fields:
        return None
    last = json.loads(fields.get("cool:last", "{}"))
    hint = last.get("hint_ms", -1)

    def number(name: str) -> int | None:
        return int(float(fields[name])) if name in fields else None

    return Feedback(number("a:limit"), number("a:min"), number("a:max"),
                    int(fields.get("cool:until", 0)) / 1000, int(fields.get("cool:count", 0)),
                    last.get("by", ""), last.get("at", 0) / 1000,
                    None if hint < 0 else hint / 1000)  # fmt: skip


def text_of(value: Any) -> str:
    """A Redis reply's value as text (bytes decoded as UTF-8, undecodable bytes replaced)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def setter(by: object = None) -> str:
    """Who makes a change from this process: ``by``, as an operator gave it, else
    ``user@host pid N``.

    Raises:
        SemaphoreValidationError: ``by`` is neither None nor a non-empty str.
    """
    if by is not None:
        return check.check_key(by, "by")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name in a bare container
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def live_limit_of(raw: Mapping[Any, Any]) -> LiveLimit | None:
    """The live limit a key's limits hash holds, read from HGETALL's reply (bytes or text),
    or None when the hash holds none."""
    fields = {text_of(k): text_of(v) for k, v in raw.items()}
    if "limit" not in fields:
        return None
    return LiveLimit(int(fields["limit"]), int(fields.get("set_at", 0)) / 1000,
                     fields.get("by", ""))  # fmt: skip


def pause_of(raw: Mapping[Any, Any]) -> Pause | None:
    """The pause a key's limits hash records, read from HGETALL's reply (bytes or text), or
    None when the key is not paused."""
    fields = {text_of(k): text_of(v) for k, v in raw.items()}
    at = fields.get("paused_at")
    return None if at is None else Pause(int(at) / 1000, fields.get("paused_by", ""))


def log_pause_change(key: str, paused: bool, was: bool, who: str) -> None:
    """Log a pause or a resume at WARNING, beside the live limits' changes."""
    if paused == was:
        logger.info("semaphore %r: already %s (%s asked)", key, "paused" if was else "running",
                    who)  # fmt: skip
    else:
        logger.warning("semaphore %r: %s by %s", key, "paused" if paused else "resumed", who)


def log_limit_change(key: str, limit: int | None, previous: int | None, who: str) -> None:
    """Log a live limit's change at WARNING, from this module's logger whichever semaphore
    made it: an operator's decision must be findable in one place."""
    logger.warning(
        "semaphore %r: live limit %s (was %s) by %s",
        key,
        "cleared" if limit is None else f"set to {limit}",
        "none" if previous is None else previous,
        who,
    )


@dataclass(frozen=True)
class LiveRate:
    """A key's live start rate of one name (see :meth:`SemaphoreAdmin.set_rate`).

    Attributes:
        name (str): the rate's name (``"requests"``, ``"tokens"``).
        spec (str): the rate as the operator gave it (``"300/m"``), with its burst.
        set_at (float): when it was set, epoch seconds by the Redis clock.
        by (str): who set it.
    """

    name: str
    spec: str
    set_at: float
    by: str


@dataclass(frozen=True)
class RateState:
    """Where one start rate of a key stands.

    Attributes:
        name (str): the rate's name.
        interval (float | None): seconds per unit at the rate in force (None: unknown here,
            no room recorded the callers' rate and no live rate is set).
        burst (int | None): units that may start at once (None: unknown, as above).
        next_due (float): when the next unit falls due, epoch seconds by the Redis clock
            (at most now: one is free now).
        left (int | None): units that may start now (None: unknown, as above).
        live (LiveRate | None): an operator's live rate of this name, if set.
        due_in (float): seconds from the server's now to ``next_due`` (0: one is free).
    """

    name: str
    interval: float | None
    burst: int | None
    next_due: float
    left: int | None
    live: LiveRate | None = None
    due_in: float = 0.0


def rate_states(raw: Mapping[Any, Any], declared: str | None, now_ms: int) -> tuple[RateState, ...]:
    """Each start rate of a key: from its limits hash (HGETALL's reply: TATs and live
    rates) and ``declared``, the rates its room last recorded (``"!rates"``, None: none),
    at the server's ``now_ms``."""
    fields = {text_of(k): text_of(v) for k, v in raw.items()}
    lives: dict[str, LiveRate] = {}  # an operator's live rates, by name
    for field, spec in fields.items():
        if field.startswith("rate_spec:"):
            name = field[len("rate_spec:") :]
            lives[name] = LiveRate(name, spec, int(fields.get("rate_at:" + name, 0)) / 1000,
                                   fields.get("rate_by:" + name, ""))  # fmt: skip
    items = (declared or "").split()
    given = {
        items[i]: (float(items[i + 1]), int(items[i + 2])) for i in range(0, len(items) - 2, 3)
    }
    names = sorted({k[4:] for k in fields if k.startswith("tat:")} | set(given) | set(lives))
    found = []
    for name in names:
        rate = fields.get("rate:" + name, "").split() or None
        interval_ms, burst = (float(rate[0]), int(rate[1])) if rate else given.get(name, (0, 0))
        # "<tat> <interval_ms>": a TAT reckoned under another interval is scaled to this
        # one, as rates.lua's rates_read does.
        tat, *under = (float(v) for v in fields.get("tat:" + name, "0").split())
        if under and interval_ms and under[0] != interval_ms and tat > now_ms:
            tat = now_ms + (tat - now_ms) * interval_ms / under[0]
        left: int | None = None
        if not interval_ms:  # no burst known: its TAT is as late as the next unit can be
            next_due = max(tat, now_ms)
        else:
            next_due = max(now_ms, tat - (burst - 1) * interval_ms)
            left = min(
                burst, max(0, math.floor((now_ms - (tat - burst * interval_ms)) / interval_ms))
            )
        found.append(RateState(name, interval_ms / 1000 if interval_ms else None,
                               burst if interval_ms else None, next_due / 1000, left,
                               lives.get(name), (next_due - now_ms) / 1000))  # fmt: skip
    return tuple(found)


def read_rate_states(
    client: Any, keys: Keys, raw: Mapping[Any, Any] | None = None
) -> tuple[RateState, ...]:
    """The start rates of the key of ``keys`` (see :func:`rate_states`), read from Redis:
    its limits hash (or ``raw``, HGETALL's reply already read), its room's ``"!rates"`` and
    the server's clock: one round trip, and one more for the clock when the key has a rate
    (() when it has none).

    Raises:
        redis.RedisError: Redis failed (the caller words it).
    """
    if raw is None:  # both keys share a hash slot: one round trip, on a cluster too
        with client.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.limits)
            pipe.hget(keys.parked, "!rates")
            raw, declared = pipe.execute()
    else:
        declared = client.hget(keys.parked, "!rates")
    if not declared and not any(text_of(k).startswith(("tat:", "rate:")) for k in raw):
        return ()
    seconds, micros = client.time()
    return rate_states(
        raw, text_of(declared) if declared else None, seconds * 1000 + micros // 1000
    )


def set_rate_call(
    keys: Keys, name: str, rate: Rate | None, by: str
) -> Call[tuple[str | None, int]]:
    """Set ``rate`` as the key's live rate of ``name`` (None: clear it): the spelling of the
    live rate before it (None: none), and the server's time."""
    args = (
        (name, "", "", by)
        if rate is None
        else (name, f"{rate.interval_ms:.6f} {rate.burst}", f"{rate.spec} burst {rate.burst}", by)
    )
    return call_of("set_rate", keys, args, lambda reply: (text_of(reply[0]) or None, int(reply[1])))


def log_rate_change(key: str, name: str, rate: Rate | None, previous: str | None, who: str) -> None:
    """Log a live rate's change at WARNING, beside the live limits' changes."""
    logger.warning("semaphore %r: live %s rate %s (was %s) by %s", key, name,
                   "cleared" if rate is None else f"set to {rate.spec} burst {rate.burst}",
                   previous or "none", who)  # fmt: skip
