"""``@bounded``: put a semaphore in front of a function, a Celery task's or any other.

Usage::

    @app.task
    @bounded("legacy-api", 5)
    def fetch_report(tenant_id): ...

    @bounded("tenant:{tenant_id}", 2, retries=50, retry_delay=0.2)   # a plain function
    def sync(tenant_id): ...

    @bounded("openai", 20, app=app, on_full="wait", wait_timeout=10)  # a coroutine function
    async def complete(prompt): ...
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from celery import Celery, Task

from ..core.feedback import Adaptive
from ..errors import SemaphoreValidationError
from .coroutines import CoroutineRunner
from .runner import Runner

F = TypeVar("F", bound=Callable[..., Any])


def bounded(
    semaphore: str | Callable[..., str] | Sequence[tuple[Any, Any]],
    limit: int | Adaptive | Callable[..., int] | Mapping[str, int] | None = None,
    *,
    weight: int | Callable[..., int] | None = None,
    fair_by: str | Callable[..., str] | None = None,
    head_start: float | Callable[..., float] | None = None,
    app: Celery | None = None,
    redis: Any = None,
    retries: int = 0,
    retry_delay: float = 0.1,
    **options: Any,
) -> Callable[[F], F]:
    """Decorate a function so that each call holds a slot of ``semaphore``.

    Put it *under* ``@app.task``. As a task, the function behaves exactly as with
    :class:`~celery_semaphore.SemaphoreTask` (in a worker, parked in the key's waiting room
    when every slot is held, unless ``on_full`` says otherwise; in eager mode, a wait).
    Called as a plain function, it fails fast with :class:`SemaphoreNotAcquiredError`, or
    retries as ``retries`` says.

    On a coroutine function (``async def``) each call awaits a slot of the same key, limit,
    prefix and Redis as the app's tasks, through an
    :class:`~celery_semaphore.asyncio.AsyncSemaphore` of the running event loop: coroutines
    and tasks count against one limit. It fails fast, or retries as ``retries`` says, or,
    when ``on_full`` (the option or the app's setting) is ``"wait"``, waits up to
    ``wait_timeout`` seconds for a release to wake it; then it raises
    :class:`SemaphoreNotAcquiredError` (an explicit ``on_full="queue"`` or ``"retry"``,
    which need a task's message, is refused). ``lease``, ``heartbeat`` and ``interrupt`` apply
    (``interrupt`` cancels the call's task when its slot is lost); a lost slot raises
    :class:`SemaphoreLeaseLostError`. Such calls send no signals or task events.

    Args:
        semaphore (str | Callable[..., str] | Sequence[tuple[Any, Any]]): the key, a
            ``str.format`` template over the function's arguments, or a callable taking them;
            or a list of ``(key, limit)`` pairs, every key held at once (then no ``limit``;
            not on a coroutine function).
        limit (int | Adaptive | Callable[..., int] | Mapping[str, int] | None): slots per
            key (an :class:`~celery_semaphore.core.feedback.Adaptive` one adapts to the
            provider's answers); or a
            callable of the function's arguments returning the limit of the run's key; or a
            mapping from key to limit, with ``"*"`` for every other key. None: the limit
            ``app.conf.semaphores`` of ``app`` (required then) declares for ``semaphore``.
        weight (int | Callable[..., int] | None): units of the limit each call takes, or a
            callable of the function's arguments returning them; None: 1.
        fair_by (str | Callable[..., str] | None): as for
            :class:`~celery_semaphore.SemaphoreTask`: the runs' fair-turn tenant.
        head_start (float | Callable[..., float] | None): as for
            :class:`~celery_semaphore.SemaphoreTask`: each run's priority in the room.
        app (Celery | None): whose ``semaphore_*`` settings a plain call uses; default the
            current app. A task always uses its own app.
        redis (redis.Redis | str | None): a client or URL to use instead of the app's
            ``semaphore_url``.
        retries (int): plain calls only: further attempts when every slot is held.
        retry_delay (float): plain calls only: seconds between attempts.
        **options: policy options (``lease``, ``heartbeat``, ``on_full``, ``wait_timeout``,
            ``queue_timeout``, ``claim_timeout``, ``handoff_grace``, ``max_queued``,
            ``on_lease_lost``, ``shed_countdown``, ``shed_backoff``, ``shed_max_countdown``,
            ``shed_max_retries``, ``shed_timeout``, ``interrupt``, ``rate``); see
            :class:`celery_semaphore.integration.policy.Policy`.

    Returns:
        Callable[[F], F]: the decorator.

    Raises:
        SemaphoreValidationError: at decoration time, when an option is invalid.
    """

    def decorate(fn: F) -> F:
        if isinstance(fn, Task) or hasattr(fn, "apply_async"):
            raise SemaphoreValidationError(
                "@bounded must go under @app.task (applied to the function first), "
                f"not above it: got the task {getattr(fn, 'name', fn)!r}"
            )
        runner = Runner(fn, semaphore, limit, options, app, redis, retries, retry_delay,
                        weight, fair_by, head_start)  # fmt: skip
        if inspect.iscoroutinefunction(fn):
            if isinstance(semaphore, (list, tuple)):
                raise SemaphoreValidationError(
                    "several keys at once are for Celery tasks and functions; on a coroutine "
                    "function give one key"
                )
            if options.get("on_full") in ("queue", "retry"):
                # Parking and shedding re-publish a task's message; a coroutine has none.
                raise SemaphoreValidationError(
                    f"on_full={options['on_full']!r} needs a Celery task; on a coroutine "
                    "function use 'wait' (with wait_timeout), 'raise', or retries="
                )
            return CoroutineRunner(runner).wrap(fn)  # type: ignore[return-value]
        wrapped: F = runner.wrap(fn)  # type: ignore[assignment]
        return wrapped

    return decorate
