"""``SemaphoreTask``: a Celery task base class whose runs hold a semaphore slot.

Usage::

    @app.task(base=SemaphoreTask, semaphore="openai", limit=20)
    def call_model(prompt): ...

    @app.task(base=SemaphoreTask, semaphore="tenant:{tenant_id}", limit=2, lease=120.0)
    def sync_tenant(tenant_id): ...

The options are ordinary ``@app.task`` keywords (Celery makes them class attributes) and are
checked when the task is bound to its app, so a bad option fails at import time with a
:class:`SemaphoreValidationError` naming it. See :mod:`celery_semaphore.integration.settings`
for every option, its app-wide setting and its default.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NoReturn

from celery import Celery, Task

from ..core import validation as check
from ..core.feedback import Adaptive
from ..core.rates import RateSpec
from ..errors import SemaphoreValidationError
from .policy import OPTION_NAMES, POLICY_FIELDS
from .runner import Runner, run_function


class SemaphoreTask(Task):  # type: ignore[misc]
    """A task whose every run holds a slot of the semaphore named by ``semaphore``.

    Class attributes (set them as ``@app.task(...)`` keywords or in a subclass):
        semaphore (str | Callable[..., str] | Sequence[tuple[Any, Any]]): the key; a
            ``str.format`` template over the task's arguments (``"tenant:{tenant_id}"``) or a
            callable taking the task's arguments; or a list of ``(key, limit)`` pairs, every
            key held at once (then no ``limit``). Required.
        limit (int | Adaptive | Callable[..., int] | Mapping[str, int]): how many runs may
            hold a slot of one key at once (an
            :class:`~celery_semaphore.core.feedback.Adaptive` one adapts to the provider's
            answers; see ``back_off_on``); or a callable of the task's arguments that
            returns the run's key's limit; or a mapping from key to limit, with ``"*"``
            for every other key.
            Leave it out when ``app.conf.semaphores`` declares the semaphore (then its
            declared options apply too, under the task's own).
        weight (int | Callable[..., int]): how many units of the limit each run takes (an
            int from 1 to the limit, or a callable of the task's arguments returning one);
            the weights of a key's runs never sum above its limit. Default 1.
        fair_by (str | Callable[..., str]): a template (or callable) naming each run's
            tenant, ``"tenant:{tenant_id}"``: runs waiting in the key's room take turns across
            tenants, so one tenant's burst does not hold back another's runs. Default: none,
            arrival order.
        head_start (float | Callable[..., float]): each run's priority in the key's room:
            seconds (0 to a day; or a callable of the task's arguments returning them) it
            parks ahead of its arrival, passing runs that came less than that before it and
            never an older one, so low priorities are delayed, never starved. Default 0.
        lease, heartbeat, on_full, wait_timeout, queue_timeout, claim_timeout, handoff_grace,
        max_queued, on_lease_lost, shed_countdown, shed_backoff, shed_max_countdown,
        shed_max_retries, shed_timeout, interrupt, rate: see
            :class:`celery_semaphore.integration.policy.Policy`; None falls back to the app's
            ``semaphore_*`` setting, then to the default.

    Raises:
        SemaphoreValidationError: at bind time, when an option is invalid.
    """

    abstract = True
    semaphore: ClassVar[str | Callable[..., str] | Sequence[tuple[Any, Any]] | None] = None
    limit: ClassVar[int | Adaptive | Callable[..., int] | Mapping[str, int] | None] = None
    weight: ClassVar[int | Callable[..., int] | None] = None
    fair_by: ClassVar[str | Callable[..., str] | None] = None
    head_start: ClassVar[float | Callable[..., float] | None] = None
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
    claim_timeout: ClassVar[float | None] = None
    max_queued: ClassVar[int | None] = None
    handoff_grace: ClassVar[float | None] = None
    wait_timeout: ClassVar[float | None] = None
    queue_timeout: ClassVar[float | None] = None
    rate: ClassVar[RateSpec] = None
    back_off_on: ClassVar[type[BaseException] | tuple[type[BaseException], ...] | None] = None
    max_back_offs: ClassVar[int | None] = None
    max_cool_down: ClassVar[float | None] = None

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Check the options and wrap ``run`` so that each run holds a slot.

        When an option is invalid, ``run`` is replaced by one that raises the same
        :class:`SemaphoreValidationError` on every call (worker, ``apply()``, eager mode, a
        direct call), so a task Celery has already bound can never run unbounded; and the
        error is raised now, which stops a worker from starting.
        """
        super().on_bound(app)
        if cls.__dict__.get("abstract"):
            return
        fn, takes_task = run_function(cls)
        if "run" in cls.__dict__ and getattr(fn, "__semaphore__", None) is not None:
            # Bound again (app.finalize() binds every task once more): keep the wrapper, which
            # Celery may already hold elsewhere (autoretry_for keeps it as task._orig_run).
            return
        # A subclass of a bound task inherits its parent's wrapper: wrap the body afresh,
        # with this class's own options and app.
        fn = getattr(fn, "__semaphore_body__", fn)
        try:
            _check_unknown_options(cls)
            options = {name: getattr(cls, name) for name in POLICY_FIELDS}
            wrapped: Any = Runner(
                fn, cls.semaphore, cls.limit, options, app=app, weight=cls.weight,
                fair_by=cls.fair_by, head_start=cls.head_start,
            ).wrap(fn)  # fmt: skip
        except SemaphoreValidationError as exc:
            error = SemaphoreValidationError(f"task {cls.name!r}: {exc}", exc.key, exc.limit)
            cls.run = refusing(fn, error) if takes_task else staticmethod(refusing(fn, error))
            raise error from None
        cls.run = wrapped if takes_task else staticmethod(wrapped)


CELERY_OPTIONS = frozenset(
    {
        *dir(Task),
        # Options Celery's task decorator takes that are not Task attributes.
        "autoretry_for",
        "dont_autoretry_for",
        "retry_kwargs",
        "retry_backoff",
        "retry_backoff_max",
        "retry_jitter",
    }
)


def _check_unknown_options(cls: type) -> None:
    """Refuse a class attribute that looks like a misspelt semaphore option.

    Celery turns every ``@app.task`` keyword into a class attribute and lets task classes
    carry attributes of their own, so an unknown name cannot be refused outright. Refused:
    a data attribute (not a method) of the task's own classes, neither a Celery task option
    nor private, whose name starts with ``semaphore`` or ``shed_`` or is close
    (:func:`difflib.get_close_matches`, cutoff 0.8) to a semaphore option's.
    """
    known = set(OPTION_NAMES)
    for klass in cls.__mro__:
        if klass is SemaphoreTask:
            return
        for name, value in vars(klass).items():
            if name.startswith("_") or name in known or name in CELERY_OPTIONS:
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                continue
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            if close or name.startswith(("semaphore", "shed_")):
                raise check.unknown_option(name, OPTION_NAMES)


def refusing(fn: Callable[..., Any], error: SemaphoreValidationError) -> Callable[..., Any]:
    """A stand-in for ``fn`` that raises ``error`` on every call and never runs ``fn``.

    It carries the error as ``__semaphore_error__`` (the worker refuses to start on it) and
    ``fn`` as ``__semaphore_body__`` (binding again checks the options afresh).
    """

    @functools.wraps(fn)
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise error

    refuse.__semaphore_error__ = error  # type: ignore[attr-defined]
    refuse.__semaphore_body__ = fn  # type: ignore[attr-defined]
    return refuse


__all__ = ["SemaphoreTask"]
