"""What the sync :class:`~celery_semaphore.core.semaphore.Semaphore` and the asyncio
:class:`~celery_semaphore.asyncio.semaphore.AsyncSemaphore` check and build alike, before
anything is sent to Redis: the constructor's options, an acquire's arguments, the
holder record an acquire stores, and a park's arguments."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ..errors import SemaphoreValidationError
from . import process
from . import validation as check
from .calls import Call, acquire_many_call
from .feedback import Adaptive
from .names import Keys, Namespace
from .rates import Rate, acquire_rates, refuse_for_many
from .replies import Admitted, Full

KeySpecs = Sequence[tuple[str, int] | tuple[str, int, int]]
"""``(key, limit)`` or ``(key, limit, weight)`` of each of several keys."""

DEFAULT_LEASE = 60.0
"""Seconds a slot lives without an extend, unless a semaphore or a call says otherwise."""


def semaphore_options(limit: int | Adaptive, lease: float, prefix: str) -> tuple[int, float, str]:
    """``(limit, lease, prefix)`` checked: an int >= 1 (an :class:`Adaptive` limit's
    ``initial``), positive finite seconds, and a non-empty str free of braces (they would
    break the keys' hash tag).

    Raises:
        SemaphoreValidationError: any of them is invalid; the message names it.
    """
    checked_limit = limit.initial if isinstance(limit, Adaptive) else check.check_limit(limit)
    check.lease_ms(lease)
    checked_prefix = check.check_key(prefix, "prefix")
    if "{" in checked_prefix or "}" in checked_prefix:
        raise SemaphoreValidationError(f"prefix must not contain braces, got {prefix!r}")
    return checked_limit, float(lease), checked_prefix


def _check_timing(
    lease: float | None, default_lease: float, retries: int, delay: float, wait: float
) -> tuple[float, int, int, float, float]:
    """An acquire's lease (seconds and ms), attempts, retry delay and wait, checked.

    Raises:
        SemaphoreValidationError: an argument is invalid, or both ``retries`` and ``wait``
            are given.
    """
    seconds = default_lease if lease is None else lease
    ms = check.lease_ms(seconds)
    attempts = check.check_retries(retries) + 1
    waiting = check.check_delay(wait, "wait")
    if waiting and attempts > 1:
        raise SemaphoreValidationError("give acquire() retries or wait, not both")
    return float(seconds), ms, attempts, check.check_delay(delay), waiting


_timing = check.memoised(_check_timing)
"""acquire's timing arguments checked, once per distinct value (see :func:`.memoised`)."""


PLAIN_KEPT = 4096
"""Keys whose checked plain acquire a semaphore keeps (then it starts afresh)."""


class AcquirePlan(NamedTuple):
    """An acquire's arguments checked, and what its script call sends (see
    :meth:`Planner.acquire`)."""

    key: str
    seconds: float
    ms: int
    attempts: int
    delay: float
    wait: float
    limit: int
    weight: int
    keys: Keys
    token: str
    """The holder's token, its record riding in it: no hash field to write, nor to delete."""
    rated: tuple[str | int, ...]
    """acquire.lua's start-rate arguments (see :func:`~.rates.acquire_rates`)."""


class Planner:
    """What one semaphore, sync or asyncio, decides before it sends anything: each call's
    arguments checked and its script call planned, so that the twins do only the I/O.

    A plain acquire, which leaves every option at its default (the very objects of the
    twin's signature, which also rules out a True for a 1), is checked when its key first
    comes, then found again.

    Args:
        limit (int): the semaphore's limit, checked.
        lease (float): its lease, seconds, checked.
        rates (tuple[Rate, ...]): its start rates.
        names (Namespace): its Redis key names.
        defaults (dict[str, Any] | None): the twin's ``acquire.__kwdefaults__``.
    """

    def __init__(
        self, limit: int, lease: float, rates: tuple[Rate, ...], names: Namespace,
        defaults: dict[str, Any] | None,
    ) -> None:  # fmt: skip
        self.limit, self.lease, self.rates, self.names = limit, lease, rates, names
        self.record = HolderRecord(limit)
        plain = defaults or {}
        self._weight, self._retries, self._delay, self._wait = (
            plain.get(name) for name in ("weight", "retries", "retry_delay", "wait")
        )
        self._plain: dict[str, AcquirePlan] = {}  # a plain call's plan, but for its token

    def limit_of(self, limit: int | None) -> int:
        """A call's ``limit`` checked; None: the semaphore's.

        Raises:
            SemaphoreValidationError: ``limit`` is invalid.
        """
        return self.limit if limit is None else check.check_limit(limit)

    def acquire(
        self, key: str, limit: int | None, weight: int, lease: float | None, retries: int,
        retry_delay: float, metadata: Mapping[str, Any] | None, wait: float,
        units: Mapping[str, int] | None,
    ) -> AcquirePlan:  # fmt: skip
        """Every argument of ``acquire`` checked (None limit and lease: the semaphore's),
        and what its script call sends.

        Raises:
            SemaphoreValidationError: an argument is invalid, or the key is one a cluster
                client cannot take.
        """
        plain = (
            type(key) is str and limit is None and lease is None and metadata is None
            and weight is self._weight and retries is self._retries
            and retry_delay is self._delay and wait is self._wait
        )  # fmt: skip
        checked = self._plain.get(key) if plain else None
        if checked is None:
            checked_key = check.check_key(key)
            timing = _timing(lease, self.lease, retries, retry_delay, wait)
            limit = self.limit_of(limit)
            checked = AcquirePlan(checked_key, *timing, limit, check.check_weight(weight, limit),
                                  self.names.keys_of(checked_key), "", ())  # fmt: skip
            if plain:
                if len(self._plain) >= PLAIN_KEPT:
                    self._plain.clear()
                self._plain[key] = checked
        token = process.member_of(self.record.encode(metadata, checked.limit, checked.weight))
        rated = acquire_rates(self.rates, units) if self.rates or units else ()
        return AcquirePlan(*checked[:-2], token, rated)

    def hold(
        self, lease: float | None, heartbeat: object, on_renew_error: object, interrupt: object
    ) -> float | None:
        """The renewal interval of a ``hold`` (one key or several), checked with the lease it
        is judged against, the renewal-error callback and ``interrupt``, before acquiring.

        Returns:
            float | None: seconds between renewals; None: no renewal (``heartbeat=False``).

        Raises:
            SemaphoreValidationError: the lease, the heartbeat (above half the lease, say),
                the callback or ``interrupt`` is invalid.
        """
        seconds = self.lease if lease is None else lease
        check.lease_ms(seconds)
        interval = check.heartbeat_interval(heartbeat, float(seconds))
        check.check_callback(on_renew_error, "on_renew_error")
        check.check_flag(interrupt, "interrupt")
        return interval

    def many(
        self, keys: object, lease: float | None, retries: int, retry_delay: float,
        metadata: Mapping[str, Any] | None,
    ) -> ManyPlan:  # fmt: skip
        """Check an ``acquire_many``'s arguments, all before anything is sent, and plan its
        script call.

        Args:
            keys (object): the ``(key, limit)`` or ``(key, limit, weight)`` tuples (see
                :func:`many_args`).
            lease (float | None): as for :meth:`acquire`; so are ``retries``,
                ``retry_delay`` and ``metadata``.

        Raises:
            SemaphoreValidationError: an argument is invalid, a key is given twice, the
                semaphore has start rates (see :func:`~.rates.refuse_for_many`), or on a
                cluster the keys share no hash slot (see
                :func:`~celery_semaphore.core.names.many_redis_keys`).
        """
        refuse_for_many(self.rates)
        specs = many_args(keys)
        names = [key for key, _, _ in specs]
        seconds, ms, attempts, delay, _ = _timing(lease, self.lease, retries, retry_delay, 0.0)
        info = self.record.encode(metadata, specs[0][1], specs[0][2])
        found = self.names.keys_of_many(names)
        token = process.new_token()
        groups = [(k, limit, weight) for k, (_, limit, weight) in zip(found, specs, strict=True)]
        return ManyPlan(specs, found, names, "+".join(names), specs[0][1], seconds, attempts,
                        delay, token, acquire_many_call(groups, ms, token, info))  # fmt: skip


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


class ManyPlan(NamedTuple):
    """An ``acquire_many``'s arguments, checked, and what its script call sends; built by
    :meth:`Planner.many` for the sync and the asyncio semaphore alike."""

    specs: list[tuple[str, int, int]]
    """``(key, limit, weight)`` of each key, in the order given."""
    keys: list[Keys]
    """The Redis keys of each."""
    names: list[str]
    """The keys, in the order given."""
    label: str
    """The keys joined with ``+``, for messages and errors."""
    limit: int
    """The first key's limit, for messages and errors."""
    seconds: float
    attempts: int
    delay: float
    token: str
    """The token all the slots share."""
    call: Call[list[Admitted] | tuple[int, Full]]
    """acquire_many.lua's call: a slot of each key under :attr:`token`, each storing the
    holder record (with the first key's limit and weight)."""

    def members(self, admitted: Sequence[Admitted]) -> list[tuple[Keys, str, Admitted, int]]:
        """``(keys, key, answer, weight)`` of each slot an admitting reply took."""
        return [(k, key, answer, weight) for k, (key, _, weight), answer
                in zip(self.keys, self.specs, admitted, strict=True)]  # fmt: skip


_RECORD_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode
"""Compact JSON with sorted keys, from one encoder (``json.dumps`` with options makes one
each call)."""


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
            text = _RECORD_JSON(record)
        except (TypeError, ValueError, RecursionError) as exc:
            raise SemaphoreValidationError(f"metadata must be JSON-serialisable: {exc}") from exc
        if plain:
            self._plain = (pid, text)
        return text
