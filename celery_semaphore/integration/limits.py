"""The ``limit`` option: a number, a callable of the task's arguments, or a mapping from key
to limit; and the semaphores an app declares once in ``app.conf.semaphores``.

Nothing here imports Celery. A live limit stored in Redis (``celery semaphore set-limit``)
wins over whatever this computes; see :meth:`SemaphoreAdmin.set_limit`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core import validation as check
from ..core.feedback import Adaptive
from ..errors import SemaphoreValidationError
from .policy import OPTION_NAMES, POLICY_FIELDS, check_options

DEFAULT_ENTRY = "*"
"""The entry of a ``limit`` mapping that applies to every key the mapping does not name."""


class LimitSpec:
    """The ``limit`` option of a bounded task, checked.

    * an int: every key's limit;
    * an :class:`~celery_semaphore.core.feedback.Adaptive`: every key's limit, adapting to
      the provider's answers from its ``initial``;
    * a callable: called with the task's own ``*args, **kwargs`` on each run, before the
      slot is asked for; it returns the run's key's limit (an int);
    * a mapping from rendered key to limit, with an optional ``"*"`` entry for every other
      key; a key it does not name, with no ``"*"``, is an error.

    Args:
        spec (int | Adaptive | Callable[..., int] | Mapping[str, int]): the option's value.

    Raises:
        SemaphoreValidationError: ``spec`` is none of these, or a number in it is not an int
            from 1 to 2**31 - 1 (the message names the entry).
    """

    def __init__(self, spec: object) -> None:
        self._call: Callable[..., Any] | None = None
        self._table: dict[str, int] = {}
        self.fixed: int | None = None
        self.adaptive: Adaptive | None = None
        if isinstance(spec, Mapping):
            if not spec:
                raise SemaphoreValidationError("limit mapping must name at least one key")
            self._table = {
                check.check_key(key, "limit mapping key"): check.check_limit(
                    value, f"limit[{key!r}]"
                )
                for key, value in spec.items()
            }
        elif callable(spec) and not isinstance(spec, type):
            self._call = spec
        elif isinstance(spec, Adaptive):
            self.fixed, self.adaptive = spec.initial, spec
        else:
            self.fixed = check.check_limit(spec)

    @property
    def default(self) -> int:
        """A limit for the semaphore object to carry (each run passes its own): the fixed
        limit, the mapping's ``"*"`` entry, else its largest, or 1 for a callable."""
        if self.fixed is not None:
            return self.fixed
        if self._table:
            return self._table.get(DEFAULT_ENTRY, max(self._table.values()))
        return 1

    @property
    def source(self) -> str:
        """The option as written, for views and log lines."""
        if self.fixed is not None:
            return repr(self.adaptive) if self.adaptive else str(self.fixed)
        if self._call is not None:
            return f"{getattr(self._call, '__qualname__', self._call)}()"
        return repr(self._table)

    def for_call(self, key: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
        """The limit of ``key`` for a run with these arguments.

        Raises:
            SemaphoreValidationError: the callable returned no valid limit, or the mapping
                has no entry for ``key`` and no ``"*"``; the message names the key.
        """
        if self.fixed is not None:
            return self.fixed
        if self._call is not None:
            value = self._call(*args, **kwargs)
            try:
                return check.check_limit(value)
            except SemaphoreValidationError as exc:
                raise SemaphoreValidationError(
                    f"limit for semaphore key {key!r} from {self.source}: {exc}", key
                ) from None
        found = self._table.get(key, self._table.get(DEFAULT_ENTRY))
        if found is None:
            raise SemaphoreValidationError(
                f"limit mapping has no entry for semaphore key {key!r} and no "
                f"{DEFAULT_ENTRY!r} entry for other keys",
                key,
            )
        return found


class WeightSpec:
    """The ``weight`` option of a bounded task: how many units of its key's limit each run
    takes; an int, or a callable of the task's own ``*args, **kwargs`` returning one.

    Args:
        spec (int | Callable[..., int] | None): the option's value; None: 1.

    Raises:
        SemaphoreValidationError: ``spec`` is neither, or an int below 1.
    """

    def __init__(self, spec: object) -> None:
        # A class is a value (refused as one), not a function of the arguments.
        self._call = spec if callable(spec) and not isinstance(spec, type) else None
        self.fixed = (
            None if self._call else check.check_limit(1 if spec is None else spec, "weight")
        )

    def for_call(
        self, key: str, limit: int, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> int:
        """The weight of a run of ``key`` (limit ``limit``) with these arguments.

        Raises:
            SemaphoreValidationError: it is not an int from 1 to ``limit``; the message names
                the key.
        """
        value = self.fixed if self._call is None else self._call(*args, **kwargs)
        try:
            return check.check_weight(value, limit)
        except SemaphoreValidationError as exc:
            raise SemaphoreValidationError(f"semaphore key {key!r}: {exc}", key, limit) from None


class HeadStartSpec:
    """The ``head_start`` option of a bounded task: each run's priority in the waiting room,
    as seconds it parks ahead of its arrival (see :meth:`WaitingRoom.park`); a number, or a
    callable of the task's own ``*args, **kwargs`` returning one.

    Args:
        spec (float | Callable[..., float] | None): the option's value; None: 0.

    Raises:
        SemaphoreValidationError: ``spec`` is neither, or not from 0 to a day.
    """

    def __init__(self, spec: object) -> None:
        # A class is a value (refused as one), not a function of the arguments.
        self._call = spec if callable(spec) and not isinstance(spec, type) else None
        self.fixed = 0.0 if self._call or spec is None else check.head_start_ms(spec) / 1000

    def for_call(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> float:
        """The head start of a run with these arguments, float seconds.

        Raises:
            SemaphoreValidationError: the callable's answer is not from 0 to a day.
        """
        if self._call is None:
            return self.fixed
        return check.head_start_ms(self._call(*args, **kwargs)) / 1000


DECLARED_OPTIONS = tuple(
    name for name in OPTION_NAMES if name not in ("semaphore", "weight", "fair_by", "head_start")
)
"""What a declaration in ``app.conf.semaphores`` may set: the limit and the policy options
(a weight, turn or head start belongs to a task, not to the semaphore it shares)."""


def declared_semaphores(value: object) -> dict[str, dict[str, Any]]:
    """``app.conf.semaphores`` checked: a mapping from the name tasks give as their
    ``semaphore`` option (a key, or a key template) to its options (``limit``, ``lease``,
    ``on_full``, ...: any task option but ``semaphore``).

    Returns:
        dict[str, dict[str, Any]]: each declaration's options, None values left out.

    Raises:
        SemaphoreValidationError: the setting is not such a mapping, names an unknown option
            (with a did-you-mean hint), or gives an invalid value; the message names the
            declaration.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SemaphoreValidationError(
            f"app.conf.semaphores must map names to options, got {type(value).__name__}"
        )
    declared: dict[str, dict[str, Any]] = {}
    for name, options in value.items():
        where = f"app.conf.semaphores[{name!r}]"
        check.check_key(name, "app.conf.semaphores name")
        if not isinstance(options, Mapping):
            raise SemaphoreValidationError(
                f"{where} must be a mapping of options, got {type(options).__name__}"
            )
        given = {str(k): v for k, v in options.items() if v is not None}
        for option in given:
            if option not in DECLARED_OPTIONS:
                raise SemaphoreValidationError(
                    f"{where}: {check.unknown_option(option, DECLARED_OPTIONS)}"
                )
        try:
            if "limit" in given:
                LimitSpec(given["limit"])
            check_options({k: v for k, v in given.items() if k in POLICY_FIELDS})
        except SemaphoreValidationError as exc:
            raise SemaphoreValidationError(f"{where}: {exc}") from None
        declared[str(name)] = given
    return declared
