"""What the sync :class:`~celery_semaphore.core.semaphore.Semaphore` and the asyncio
:class:`~celery_semaphore.asyncio.semaphore.AsyncSemaphore` check and build alike, before
anything is sent to Redis: the constructor's options, an acquire's arguments, and the
holder record an acquire stores."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from typing import Any, NamedTuple

from ..errors import SemaphoreValidationError
from . import process
from . import validation as check


def semaphore_options(limit: int, lease: float, prefix: str) -> tuple[int, float, str]:
    """``(limit, lease, prefix)`` checked: an int >= 1, positive finite seconds, and a
    non-empty str free of braces (they would break the keys' hash tag).

    Raises:
        SemaphoreValidationError: any of them is invalid; the message names it.
    """
    checked_limit = check.check_limit(limit)
    check.lease_ms(lease)
    checked_prefix = check.check_key(prefix, "prefix")
    if "{" in checked_prefix or "}" in checked_prefix:
        raise SemaphoreValidationError(f"prefix must not contain braces, got {prefix!r}")
    return checked_limit, float(lease), checked_prefix


class AcquireArgs(NamedTuple):
    """An acquire's arguments, checked (see :func:`acquire_args`)."""

    key: str
    seconds: float
    ms: int
    attempts: int
    delay: float
    wait: float


def acquire_args(
    key: str, lease: float | None, default_lease: float, retries: int, delay: float, wait: float
) -> AcquireArgs:
    """The arguments of ``acquire`` checked, with the lease in seconds and ms and the number
    of attempts.

    Raises:
        SemaphoreValidationError: an argument is invalid, or both ``retries`` and ``wait``
            are given.
    """
    key = check.check_key(key)
    # Callers pass the same few timings again and again: each is checked once. The types
    # are part of the memo, so True is not taken for a valid 1.
    memo = (lease, default_lease, retries, delay, wait,
            type(lease), type(retries), type(delay), type(wait))  # fmt: skip
    try:
        timing = _CHECKED.get(memo)
    except TypeError:  # an unhashable argument, which the checks refuse
        timing = None
    if timing is None:
        timing = _timing(lease, default_lease, retries, delay, wait)
        if len(_CHECKED) < _MEMO_SIZE:
            _CHECKED[memo] = timing
    return AcquireArgs(key, *timing)


_MEMO_SIZE = 256
_CHECKED: dict[tuple[object, ...], tuple[float, int, int, float, float]] = {}
"""Checked timings of acquire, by their arguments and types (see :func:`acquire_args`)."""


def _timing(
    lease: float | None, default_lease: float, retries: int, delay: float, wait: float
) -> tuple[float, int, int, float, float]:
    seconds = default_lease if lease is None else lease
    ms = check.lease_ms(seconds)
    attempts = check.check_retries(retries) + 1
    waiting = check.check_delay(wait, "wait")
    if waiting and attempts > 1:
        raise SemaphoreValidationError("give acquire() retries or wait, not both")
    return float(seconds), ms, attempts, check.check_delay(delay), waiting


def many_args(keys: object) -> list[tuple[str, int, int]]:
    """The keys of ``acquire_many`` checked, as ``(key, limit, weight)`` triples.

    Raises:
        SemaphoreValidationError: ``keys`` is not a non-empty sequence of ``(key, limit)`` or
            ``(key, limit, weight)`` tuples with valid values, or names a key twice.
    """
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)) or not keys:
        raise SemaphoreValidationError(
            f"keys must be a non-empty list of (key, limit) pairs, got {keys!r:.80}"
        )
    specs = []
    for entry in keys:
        if not isinstance(entry, tuple) or len(entry) not in (2, 3):
            raise SemaphoreValidationError(
                f"each of keys must be (key, limit) or (key, limit, weight), got {entry!r:.80}"
            )
        key = check.check_key(entry[0])
        limit = check.check_limit(entry[1])
        weight = check.check_weight(entry[2] if len(entry) == 3 else 1, limit)
        specs.append((key, limit, weight))
    if len({key for key, _, _ in specs}) < len(specs):
        raise SemaphoreValidationError(f"keys name a key twice: {[k for k, _, _ in specs]!r}")
    return specs


class HolderRecord:
    """Encodes what an acquire stores about its holder: the caller's metadata plus ``host``,
    ``pid`` and ``limit``, as compact JSON. The record of a plain acquire (no metadata) is
    the same for every acquire of a process, so it is encoded once per process.

    Args:
        limit (int): the semaphore's limit, recorded with each holder.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._host = socket.gethostname()
        self._plain = (0, "")  # (pid, JSON) of a plain acquire's record

    def encode(
        self, metadata: Mapping[str, Any] | None, limit: int | None = None, weight: int = 1
    ) -> str:
        """The JSON record for an acquire with ``metadata`` under ``limit`` (None: the
        semaphore's), of ``weight`` units (recorded when above 1).

        Raises:
            SemaphoreValidationError: ``metadata`` is not a JSON-serialisable mapping.
        """
        if metadata is not None and not isinstance(metadata, Mapping):
            raise SemaphoreValidationError(
                f"metadata must be a mapping or None, got {type(metadata).__name__}"
            )
        pid = process.pid()
        plain = not metadata and limit in (None, self.limit) and weight == 1
        if plain and self._plain[0] == pid:
            return self._plain[1]
        # host, pid and limit are facts about the holder: the caller's metadata cannot change them.
        record = {**(metadata or {}), "host": self._host, "pid": pid, "limit": limit or self.limit}
        if weight != 1:
            record["weight"] = weight
        try:
            text = json.dumps(record, separators=(",", ":"), sort_keys=True)
        except (TypeError, ValueError, RecursionError) as exc:
            raise SemaphoreValidationError(f"metadata must be JSON-serialisable: {exc}") from exc
        if plain:
            self._plain = (pid, text)
        return text
