"""Live limits: a key's limit set in Redis by an operator, which wins over the limit its
callers give until it is cleared, and a key's pause, which makes that limit 0 until it is
resumed (``set_limit.lua``). What the sync and asyncio admins share
about them: the record, reading it, who makes a change and logging it; a change is checked
and decided by :class:`~celery_semaphore.core.admin.AdminTrips`, and the round trips are
:meth:`SemaphoreAdmin.set_limit <celery_semaphore.core.admin.SemaphoreAdmin.set_limit>` and its
asyncio twin's."""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import validation as check

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
