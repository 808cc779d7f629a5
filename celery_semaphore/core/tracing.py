"""An OpenTelemetry span around each acquire, when ``opentelemetry-api`` is installed.

The span is ``semaphore.acquire`` with attributes ``semaphore.key``, ``semaphore.limit``,
``semaphore.attempts`` and ``semaphore.outcome`` (``acquired`` or ``full``; for the waiting
room's park and claim, ``acquired``, ``parked``, ``room full`` or ``none``; a Redis failure is
recorded as the span's exception). An acquire of several keys at once is one span, whose
``semaphore.key`` joins the keys with ``+`` and whose ``semaphore.keys`` lists them apart,
so a query by one key finds it (its ``semaphore.limit`` is the first key's).

A run that fails for want of a slot adds a ``semaphore.refused`` event, with its
``semaphore.refusal`` (see :class:`~celery_semaphore.errors.Refusal`), to the span current
then (see :func:`refusal_event`).

Without an SDK configured the API's spans are no-ops, and without the package installed
nothing is imported: ``pip install 'celery-semaphore[tracing]'`` to have it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

try:
    from opentelemetry import trace
except ImportError:  # the optional extra is not installed
    trace: Any = None  # type: ignore[no-redef]

Record = Callable[[int, str], None]


def _ignore(attempts: int, outcome: str) -> None:
    """What records an acquire's end when there is no tracer."""


_NO_SPAN = contextlib.nullcontext(_ignore)
"""The span of an acquire when no tracer is installed: one shared object, entered for
nothing."""

_UNREAD = object()
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
"""Whether the environment names a tracer provider, read once at import:
``trace.get_tracer_provider()`` looks it up in ``os.environ`` on every call while no
provider is set, which costs as much as the rest of an acquire's own work."""


def _no_tracer() -> bool:
    """Whether no tracer provider is configured, so a span would record nothing."""
    if trace is None:
        return True
    # The API's global is set once and never unset: while it is None and the environment
    # named none, nothing is configured. Should the API lose that global, ask it instead.
    provider = getattr(trace, "_TRACER_PROVIDER", _UNREAD)
    if provider is None and not _PROVIDER_FROM_ENV:
        return True
    return isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def acquire_span(
    key: str, limit: int, keys: Sequence[str] = ()
) -> contextlib.AbstractContextManager[Record]:
    """Wrap one acquire (all its attempts) in a span; entering it gives
    ``record(attempts, outcome)``.

    Args:
        key (str): the key, or the keys joined with ``+``.
        limit (int): the (first key's) limit.
        keys (Sequence[str]): for an acquire of several keys, each of them, recorded as
            ``semaphore.keys``; empty for one key.
    """
    # With no SDK configured the API's spans record nothing, yet entering one costs more
    # than the rest of an acquire's client-side work: skip it.
    if _no_tracer():
        return _NO_SPAN
    return _span(key, limit, keys)


@contextlib.contextmanager
def _span(key: str, limit: int, keys: Sequence[str]) -> Iterator[Record]:
    tracer = trace.get_tracer("celery_semaphore")
    attributes: dict[str, str | int | list[str]] = {"semaphore.key": key, "semaphore.limit": limit}
    if keys:
        attributes["semaphore.keys"] = list(keys)
    with tracer.start_as_current_span("semaphore.acquire", attributes=attributes) as span:

        def record(attempts: int, outcome: str) -> None:
            span.set_attribute("semaphore.attempts", attempts)
            span.set_attribute("semaphore.outcome", outcome)

        yield record


def refusal_event(key: str, limit: int | None, reason: str) -> None:
    """Add a ``semaphore.refused`` event (``semaphore.key``, ``semaphore.limit``,
    ``semaphore.refusal``) to the current span, when a tracer is configured and a span
    records: the task's own span, say, from Celery's OpenTelemetry instrumentation. An
    acquire's span has ended by the time a run is refused, so the run's span carries it."""
    if _no_tracer():
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    attributes: dict[str, str | int] = {"semaphore.key": key, "semaphore.refusal": reason}
    if limit is not None:
        attributes["semaphore.limit"] = limit
    span.add_event("semaphore.refused", attributes)
