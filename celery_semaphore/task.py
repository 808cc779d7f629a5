"""``SemaphoreTask``: a Celery task base class whose runs hold a semaphore slot.

Usage::

    @app.task(base=SemaphoreTask, semaphore="openai", limit=20)
    def call_model(prompt): ...

    @app.task(base=SemaphoreTask, semaphore="tenant:{tenant_id}", limit=2, lease=120.0)
    def sync_tenant(tenant_id): ...

The options are ordinary ``@app.task`` keywords (Celery makes them class attributes) and are
checked when the task is bound to its app, so a bad option fails at import time with a
:class:`SemaphoreValidationError` naming it. See :mod:`celery_semaphore.config` for every
option, its app-wide setting and its default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar

from celery import Celery, Task

from .bounded import Bounded
from .config import POLICY_FIELDS
from .errors import SemaphoreValidationError


class SemaphoreTask(Task):  # type: ignore[misc]
    """A task whose every run holds a slot of the semaphore named by ``semaphore``.

    Class attributes (set them as ``@app.task(...)`` keywords or in a subclass):
        semaphore (str | Callable[..., str]): the key; a ``str.format`` template over the
            task's arguments (``"tenant:{tenant_id}"``) or a callable taking the task's
            arguments. Required.
        limit (int): how many runs may hold a slot of one key at once. Required.
        lease, heartbeat, on_full, on_lease_lost, shed_countdown, shed_backoff,
        shed_max_countdown, shed_max_retries, shed_timeout, interrupt: see
            :class:`celery_semaphore.config.Policy`; None falls back to the app's
            ``semaphore_*`` setting, then to the default.

    Raises:
        SemaphoreValidationError: at bind time, when an option is invalid.
    """

    abstract = True
    semaphore: ClassVar[str | Callable[..., str] | None] = None
    limit: ClassVar[int | None] = None
    lease: ClassVar[float | None] = None
    heartbeat: ClassVar[float | bool | None] = None
    on_full: ClassVar[str | None] = None
    on_lease_lost: ClassVar[str | None] = None
    shed_countdown: ClassVar[float | None] = None
    shed_backoff: ClassVar[bool | None] = None
    shed_max_countdown: ClassVar[float | None] = None
    shed_max_retries: ClassVar[int | None] = None
    shed_timeout: ClassVar[float | None] = None
    interrupt: ClassVar[bool | None] = None

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Check the options and wrap ``run`` so that each run holds a slot."""
        super().on_bound(app)
        if cls.__dict__.get("abstract"):
            return
        run = inspect.getattr_static(cls, "run")
        is_static = isinstance(run, staticmethod)
        fn = run.__func__ if is_static else run
        if "run" in cls.__dict__ and getattr(fn, "__semaphore__", None) is not None:
            # Bound again (app.finalize() binds every task once more): keep the wrapper, which
            # Celery may already hold elsewhere (autoretry_for keeps it as task._orig_run).
            return
        # A subclass of a bound task inherits its parent's wrapper: wrap the body afresh,
        # with this class's own options and app.
        fn = getattr(fn, "__semaphore_body__", fn)
        options = {name: getattr(cls, name) for name in POLICY_FIELDS}
        try:
            bounded = Bounded(fn, cls.semaphore, cls.limit, options, app=app)
        except SemaphoreValidationError as exc:
            raise SemaphoreValidationError(
                f"task {cls.name!r}: {exc}", exc.key, exc.limit
            ) from None
        wrapped: Any = bounded.wrap(fn)
        cls.run = staticmethod(wrapped) if is_static else wrapped


__all__ = ["SemaphoreTask"]
