"""Live limits: a key's limit set in Redis by an operator, which wins over the limit its
callers give until it is cleared (``set_limit.lua``). :class:`LiveLimits` holds the methods
:class:`~celery_semaphore.core.admin.SemaphoreAdmin` offers for it."""

from __future__ import annotations

import getpass
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis

from . import validation as check
from .room import HandoffRoute
from .scripts import Keys, Scripts, backend_errors

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


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def setter() -> str:
    """Who is setting a limit from this process: ``user@host pid N``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name in a bare container
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def live_limit_of(raw: Mapping[Any, Any]) -> LiveLimit | None:
    """The live limit a key's limits hash holds, read from HGETALL's reply (bytes or text),
    or None when the hash holds none."""
    fields = {_text(k): _text(v) for k, v in raw.items()}
    if "limit" not in fields:
        return None
    return LiveLimit(int(fields["limit"]), int(fields.get("set_at", 0)) / 1000,
                     fields.get("by", ""))  # fmt: skip


def limit_change(key: object, limit: object, by: object) -> tuple[str, int | None, str]:
    """The arguments of a ``set_limit`` (sync or asyncio) checked: the key, the new limit
    (None clears it) and who sets it (``by``, else :func:`setter`).

    Raises:
        SemaphoreValidationError: ``key``, ``limit`` or ``by`` is invalid.
    """
    checked = check.check_key(key)
    new = None if limit is None else check.check_limit(limit)
    return checked, new, setter() if by is None else check.check_key(by, "by")


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


class LiveLimits:
    """The live-limit methods of :class:`~celery_semaphore.core.admin.SemaphoreAdmin` (the
    attributes and the method below are the admin's own)."""

    client: redis.Redis
    handoffs: HandoffRoute
    _scripts: Scripts

    def keys_of(self, key: str) -> Keys:
        raise NotImplementedError

    def live_limit(self, key: str) -> LiveLimit | None:
        """The live limit of ``key``, or None when none is set (one round trip).

        Raises:
            SemaphoreValidationError: ``key`` is not a non-empty str.
            SemaphoreBackendError: Redis failed.
        """
        keys = self.keys_of(check.check_key(key))
        with backend_errors(key):
            return live_limit_of(self.client.hgetall(keys.limits))

    def set_limit(self, key: str, limit: int | None, by: str | None = None) -> int | None:
        """Set the live limit of ``key``, which wins over the limit every caller gives until it
        is cleared; None clears it (callers' own limits apply again). One round trip; the
        change is logged (who, from which host and pid) and shown by the views.

        Lowering the limit evicts no holder: new ones are refused until the key is under it.
        Raising it hands the freed capacity to the oldest parked waiters in the same script
        call (published through this admin's hand-off route; with no publisher, the next
        sweep hands them out) and wakes callers waiting in ``acquire(wait=...)``.

        Args:
            key (str): the semaphore's key.
            limit (int | None): the new limit (1 to 2**31 - 1), or None to clear.
            by (str | None): who sets it, for the views; None: ``user@host pid N``.

        Returns:
            int | None: the live limit it replaced (None: there was none).

        Raises:
            SemaphoreValidationError: ``key``, ``limit`` or ``by`` is invalid (nothing is sent).
            SemaphoreBackendError: Redis failed.
        """
        key, limit, who = limit_change(key, limit, by)
        keys = self.keys_of(key)
        with backend_errors(key, limit):
            previous, _, handed = self._scripts.set_limit(
                keys, limit, who, self.handoffs.release_claim_ms
            )
        self.handoffs.deliver(key, handed)
        log_limit_change(key, limit, previous, who)
        return previous
