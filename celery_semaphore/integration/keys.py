"""The ``semaphore`` option: which key a run takes a slot of.

A fixed key, a ``str.format`` template over the task's arguments, or a callable; see
:class:`KeyTemplate`. Nothing here imports Celery.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core import validation as check
from ..errors import SemaphoreValidationError
from .limits import LimitSpec


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
        self._call: Callable[..., str] | None = spec if callable(spec) else None
        self._template = "" if callable(spec) else check.check_key(spec, "semaphore")
        fields = _fields(self._template)
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

    @property
    def sources(self) -> tuple[str]:
        """The one key's :attr:`source`, as :attr:`KeySet.sources` gives each of several."""
        return (self.source,)

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


class KeySet:
    """The ``semaphore`` option as a list: several keys a run holds all at once, each with
    its own limit, ``[("openai", 20), ("tenant:{tenant_id}", 2)]``.

    Each key is a fixed key, a template or a callable, as for :class:`KeyTemplate`; each
    limit is a number, a callable or a mapping, as for
    :class:`~celery_semaphore.integration.limits.LimitSpec`.

    Args:
        spec (Sequence[tuple[str | Callable[..., str], object]]): the option's value.
        fn (Callable[..., Any]): the function whose signature the templates are checked
            against.

    Raises:
        SemaphoreValidationError: ``spec`` is empty or not a list of ``(key, limit)`` pairs,
            or a key or limit in it is invalid (the message names it).
    """

    def __init__(self, spec: Sequence[Any], fn: Callable[..., Any]) -> None:
        if not spec or not all(isinstance(e, tuple) and len(e) == 2 for e in spec):
            raise SemaphoreValidationError(
                "semaphore as a list takes (key, limit) pairs, at least one, e.g. "
                f"[('openai', 20), ('tenant:{{tenant_id}}', 2)]; got {spec!r:.80}"
            )
        self.entries = [(KeyTemplate(key, fn), LimitSpec(limit)) for key, limit in spec]

    @property
    def source(self) -> str:
        """The keys as written, joined with ``+`` (for views and log lines)."""
        return "+".join(self.sources)

    @property
    def sources(self) -> tuple[str, ...]:
        """Each key as written, in order (for signals and metrics that name keys apart)."""
        return tuple(template.source for template, _ in self.entries)

    def render_each(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[str]:
        """Each key for one call (see :meth:`KeyTemplate.render`)."""
        return [template.render(args, kwargs) for template, _ in self.entries]

    def render(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The keys for one call, joined with ``+`` (a label, for log lines)."""
        return "+".join(self.render_each(args, kwargs))
