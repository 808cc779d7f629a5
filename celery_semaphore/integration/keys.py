"""The ``semaphore`` option: which key a run takes a slot of.

A fixed key, a ``str.format`` template over the task's arguments, or a callable; see
:class:`KeyTemplate`. Nothing here imports Celery.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Mapping
from typing import Any

from ..core import validation as check
from ..errors import SemaphoreValidationError


class KeyTemplate:
    """The ``semaphore`` option: a fixed key, a ``str.format`` template, or a callable.

    A template such as ``"tenant:{tenant_id}"`` is filled from the task's arguments, bound to
    the signature of its function (defaults applied); a callable is called with the task's
    own ``*args, **kwargs`` and must return a non-empty str.

    Args:
        spec (str | Callable[..., str]): the option's value.
        fn (Callable[..., Any]): the function whose signature the template is checked against.

    Raises:
        SemaphoreValidationError: ``spec`` is empty, not a str or callable, uses positional
            fields (``{}``, ``{0}``), or names an argument ``fn`` does not take.
    """

    def __init__(self, spec: object, fn: Callable[..., Any]) -> None:
        if callable(spec):
            self._call: Callable[..., str] | None = spec
            self._template = ""
            self._signature: inspect.Signature | None = None
            return
        check.check_key(spec, "semaphore")
        assert isinstance(spec, str)
        self._call = None
        self._template = spec
        fields = _fields(spec)
        self._signature = inspect.signature(fn) if fields else None
        if self._signature is not None:
            params = self._signature.parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            unknown = [f for f in fields if f not in params and not takes_any]
            if unknown:
                raise SemaphoreValidationError(
                    f"semaphore template {spec!r} names {', '.join(unknown)}, which "
                    f"{getattr(fn, '__qualname__', fn)!r} does not take"
                )

    @property
    def source(self) -> str:
        """The option as written: the template (or key), or the callable's qualified name."""
        if self._call is not None:
            return str(getattr(self._call, "__qualname__", self._call))
        return self._template

    def render(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The key for one call.

        Raises:
            TypeError: the arguments do not fit the function's signature.
            SemaphoreValidationError: the rendered key is not a non-empty str.
        """
        if self._call is not None:
            return check.check_key(self._call(*args, **kwargs), "semaphore key")
        if self._signature is None:
            return self._template
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        for param in self._signature.parameters.values():
            if param.kind is param.VAR_KEYWORD:
                values.update(values.pop(param.name, {}))
        try:
            key = self._template.format(**values)
        except (KeyError, AttributeError, IndexError, ValueError, TypeError) as exc:
            raise SemaphoreValidationError(
                f"semaphore template {self._template!r} cannot be filled: {exc!r}"
            ) from exc
        return check.check_key(key, "semaphore key")


def _fields(template: str) -> list[str]:
    """Root names of the replacement fields in a ``str.format`` template."""
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise SemaphoreValidationError(f"semaphore template {template!r}: {exc}") from None
    for _, field, _, _ in parsed:
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise SemaphoreValidationError(
                f"semaphore template {template!r} must name its fields, e.g. {{tenant_id}}"
            )
        names.append(root)
    return names
