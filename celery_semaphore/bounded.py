"""Run a task's body under a semaphore slot: the part of the Celery glue that acts.

:class:`SemaphoreTask` and :func:`bounded` both build one :class:`Bounded` per task and put
its :meth:`Bounded.wrap` around the task's ``run``. Celery calls ``run`` on every path (the
``celery worker`` tracer, in-process test workers, ``apply()``/eager mode and a direct
``task(...)`` call), so wrapping ``run`` rather than overriding ``Task.__call__`` bounds each of
them the same way, and its ``finally`` runs before Celery stores a result, retries, ignores or
rejects.

How a run goes:

* In a worker, a run that finds every slot held (or Redis unreachable) is *shed*: the same
  message (same id, same ``retries``) is published again with a countdown and the run ends in
  state RETRY. The shed count travels in the ``semaphore_sheds`` message header, so a task's
  ``max_retries`` and ``request.retries`` only ever count its own retries.
* Outside a worker (eager mode, ``apply()``, a direct call) nothing is published: the run
  waits for a slot up to its budget, then raises :class:`SemaphoreNotAcquiredError`.
* A plain function (not running as a task) fails fast, or retries as ``retries`` says.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import math
import random
import string
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from celery import Celery, Task
from celery._state import get_current_app, get_current_task
from celery.exceptions import Ignore

from . import _validation as check
from .config import POLICY_FIELDS, Policy, app_settings, client_for, countdown
from .errors import (
    SemaphoreBackendError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from .interrupt import Interrupter
from .semaphore import DEFAULT_PREFIX, Semaphore, Slot, guard
from .signals import (
    semaphore_acquired,
    semaphore_lease_lost,
    semaphore_refused,
    semaphore_released,
    semaphore_renew_failed,
    semaphore_shed,
    send_event,
)
from .stats import bump

# A plain child of the package's logger, so that configuring "celery_semaphore" configures
# it; each line names its task itself (a Celery task logger would not be such a child).
logger = logging.getLogger(__name__)

SHEDS_HEADER = "semaphore_sheds"
"""Message header: how many times this task was shed so far."""
FIRST_SHED_HEADER = "semaphore_first_shed_at"
"""Message header: epoch seconds of the first shed, for the ``shed_timeout`` budget."""
SHED_ATTEMPT_HEADER = "semaphore_shed_attempt"
"""Message header: the ``request.retries`` the two above count for. Each attempt (each retry
the task asks for itself) gets a fresh shed budget, so a user's ``self.retry()`` or
``autoretry_for`` is never refused for sheds an earlier attempt spent."""

BROKER_HEADERS = frozenset(
    {
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
        "x-delivery-count",
    }
)
"""Headers RabbitMQ adds to a delivered message. Published again, RabbitMQ (before 4.0.1,
with quorum queues and delayed delivery) takes the message for a dead-letter cycle and drops
it; Celery's own ``retry()`` leaves the ``x-death`` family out (5.7 and later) for that
reason, and a shed leaves out all of them whatever the Celery version."""


def retry_headers(request: Any) -> dict[str, Any]:
    """The headers Celery's own ``retry()`` would publish for ``request``, less anything the
    broker added (:data:`BROKER_HEADERS`)."""
    headers = request.as_execution_options().get("headers") or {}
    return {k: v for k, v in headers.items() if k not in BROKER_HEADERS}


KeySpec = str | Callable[..., str]

OPTION_NAMES = ("semaphore", "limit", *POLICY_FIELDS)
"""Every semaphore option a task or ``@bounded`` takes."""

_current_slot: contextvars.ContextVar[Slot | None] = contextvars.ContextVar(
    "celery_semaphore_current_slot", default=None
)


def current_slot() -> Slot | None:
    """The slot held by the bounded task (or function) running in this thread, or None.

    Long bodies can watch ``current_slot().lost`` to stop early when the slot is gone.
    """
    return _current_slot.get()


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


class Bounded:
    """A task body's semaphore: its key, limit and policy options, and how to run under it.

    Args:
        fn (Callable[..., Any]): the body, used to check a key template against.
        semaphore (str | Callable[..., str]): the key option (see :class:`KeyTemplate`).
        limit (int): slots per key.
        options (Mapping[str, Any]): task-level policy options (names as in
            :class:`~celery_semaphore.config.Policy`); None values fall through to the app's
            settings.
        app (Celery | None): the app whose settings apply when the body runs outside a task.
        redis (redis.Redis | str | None): the Redis to use instead of the app's
            ``semaphore_url``.
        retries (int): for a plain function call only: further attempts when all slots
            are held (0: fail fast).
        retry_delay (float): for a plain function call only: seconds between attempts.

    Raises:
        SemaphoreValidationError: any option is invalid; the message names it.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        semaphore: object,
        limit: object,
        options: Mapping[str, Any],
        app: Celery | None = None,
        redis: Any = None,
        retries: int = 0,
        retry_delay: float = 0.1,
    ) -> None:
        unknown = sorted(set(options) - set(POLICY_FIELDS))
        if unknown:
            raise check.unknown_option(unknown[0], OPTION_NAMES)
        if semaphore is None:
            raise SemaphoreValidationError("semaphore option is required (the key to bound by)")
        self.key = KeyTemplate(semaphore, fn)
        self.limit = check.check_limit(limit)
        self.options = {k: v for k, v in options.items() if v is not None}
        Policy().with_options(self.options)  # checks each given option now
        if app is not None and not isinstance(app, Celery):
            raise SemaphoreValidationError(f"app must be a Celery app or None, got {app!r}")
        self.app = app
        self.redis = redis
        self.retries = check.check_retries(retries)
        self.retry_delay = check.check_delay(retry_delay)
        self._lock = threading.Lock()
        self._resolved: dict[int, tuple[Semaphore, Policy]] = {}

    def __repr__(self) -> str:
        return f"<Bounded limit={self.limit} options={self.options}>"

    def resolve(self, app: Celery | None) -> tuple[Semaphore, Policy]:
        """The semaphore and the effective policy for runs under ``app`` (cached).

        With no app (a plain call of a function given ``redis=``), the built-in defaults
        stand in for the app's settings.

        Raises:
            SemaphoreValidationError: an app setting is invalid, or conflicts with this
                task's options (say an app-wide heartbeat above half the task's lease).
        """
        found = self._resolved.get(id(app))
        if found is not None:
            return found
        with self._lock:
            found = self._resolved.get(id(app))
            if found is None:
                if app is None:
                    prefix, defaults = DEFAULT_PREFIX, Policy()
                else:
                    settings = app_settings(app)
                    prefix, defaults = settings.prefix, settings.policy
                policy = defaults.with_options(self.options)
                client = self.redis if self.redis is not None else client_for(app)
                semaphore = Semaphore(client, self.limit, policy.lease, prefix)
                found = self._resolved[id(app)] = (semaphore, policy)
            return found

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` wrapped to run under this semaphore; the wrapper keeps ``fn``'s signature.

        The wrapper carries this object as ``__semaphore__``, which is how the worker-side
        signal handlers find a task's semaphore.
        """

        @functools.wraps(fn)
        def run_bounded(*args: Any, **kwargs: Any) -> Any:
            return self.call(run_bounded, fn, args, kwargs)

        run_bounded.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        run_bounded.__semaphore__ = self  # type: ignore[attr-defined]
        run_bounded.__semaphore_body__ = fn  # type: ignore[attr-defined]
        return run_bounded

    def call(
        self,
        wrapper: Callable[..., Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` under a slot, choosing the mode from Celery's state."""
        task = get_current_task()
        if task is None or _unwrap_run(task) is not wrapper:
            return self._call_plain(fn, args, kwargs)
        request = task.request
        if request.is_eager or request.called_directly:
            return self._call_waiting(task, fn, args, kwargs)
        return self._call_in_worker(task, fn, args, kwargs)

    def key_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The semaphore key for a call with these arguments (see :class:`KeyTemplate`)."""
        return self.key.render(args, kwargs)

    # -- the three modes ---------------------------------------------------------------

    def _call_plain(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
        app = self.app if self.app is not None or self.redis is not None else get_current_app()
        semaphore, policy = self.resolve(app)
        key = self.key_for(args, kwargs)
        started = time.monotonic()
        slot = semaphore.acquire(key, retries=self.retries, retry_delay=self.retry_delay)
        if slot is None:
            raise self._refused(None, _full_error(key, self.limit))
        return self._run(None, slot, policy, time.monotonic() - started, fn, args, kwargs)

    def _call_waiting(self, task: Task, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        semaphore, policy = self.resolve(task.app)
        key = self.key_for(args, kwargs)
        budget = policy.wait_budget()
        delay = min(0.1, budget) if budget else 0.0
        retries = math.ceil(budget / delay) if delay else 0
        started = time.monotonic()
        slot = semaphore.acquire(
            key, retries=retries, retry_delay=delay, metadata=_task_metadata(task)
        )
        if slot is None:
            raise self._refused(
                task,
                SemaphoreNotAcquiredError(
                    f"semaphore {key!r} had all {self.limit} slots held for {budget:g}s "
                    f"(task {task.name} run outside a worker waits instead of being shed)",
                    key,
                    self.limit,
                ),
            )
        return self._run(task, slot, policy, time.monotonic() - started, fn, args, kwargs)

    def _call_in_worker(self, task: Task, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        key = self.key_for(args, kwargs)
        started = time.monotonic()
        try:
            # A cluster client connects when it is made, so resolving can fail like acquiring.
            semaphore, policy = self.resolve(task.app)
            slot = semaphore.acquire(key, metadata=_task_metadata(task))
        except SemaphoreBackendError as exc:
            policy = app_settings(task.app).policy.with_options(self.options)
            if policy.on_full == "raise":
                raise
            self._shed(task, policy, key, f"Redis unreachable: {exc}")
        if slot is None:
            if policy.on_full == "raise":
                raise self._refused(task, _full_error(key, self.limit))
            self._shed(task, policy, key, "all slots held")
        try:
            return self._run(task, slot, policy, time.monotonic() - started, fn, args, kwargs)
        except SemaphoreLeaseLostError:
            if policy.on_lease_lost != "retry" or not slot.lost.is_set():
                raise
            self._shed(task, policy, key, "slot lost while running")

    # -- running the body --------------------------------------------------------------

    def _run(
        self,
        task: Task | None,
        slot: Slot,
        policy: Policy,
        waited: float,
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
    ) -> Any:
        """Run the body holding ``slot``; report the moments of its life (see signals)."""
        interval = check.heartbeat_interval(policy.heartbeat, slot.lease)
        interrupter = Interrupter(slot) if policy.interrupt else None
        template = self.key.source
        semaphore_acquired.send(
            sender=task, key=slot.key, limit=slot.limit, template=template, slot=slot, waited=waited
        )
        send_event(task, "acquired", key=slot.key, limit=slot.limit, waited=waited)
        started = time.monotonic()
        try:
            with guard(slot, interval, _renew_failed(task, slot, template)):
                token = _current_slot.set(slot)
                try:
                    if interrupter is None:
                        return fn(*args, **kwargs)
                    with interrupter:
                        return fn(*args, **kwargs)
                finally:
                    _current_slot.reset(token)
        except SemaphoreLeaseLostError:
            if not slot.lost.is_set():
                raise  # another semaphore's loss, inside the body: not ours to restate
            raise slot.lease_lost_error() from None
        finally:
            semaphore_released.send(
                sender=task,
                key=slot.key,
                limit=slot.limit,
                template=template,
                slot=slot,
                held=time.monotonic() - started,
                lost=slot.lost.is_set(),
            )
            if slot.lost.is_set():
                _lease_lost(task, slot, template)

    def _refused(
        self, task: Task | None, error: SemaphoreNotAcquiredError
    ) -> SemaphoreNotAcquiredError:
        """Report that a run will not get a slot (no shed: it fails); returns ``error``."""
        semaphore_refused.send(
            sender=task,
            key=error.key,
            limit=error.limit,
            template=self.key.source,
            reason=error.message,
        )
        return error

    def _shed(self, task: Task, policy: Policy, key: str, reason: str) -> NoReturn:
        """Shed the running task (see :func:`_shed`), or fail it when its budget is spent."""
        try:
            _shed(task, policy, key, self.limit, self.key.source, reason)
        except SemaphoreNotAcquiredError as exc:
            raise self._refused(task, exc) from None


def _unwrap_run(task: Task) -> Any:
    run = inspect.getattr_static(type(task), "run", None)
    return run.__func__ if isinstance(run, staticmethod) else run


def _full_error(key: str, limit: int) -> SemaphoreNotAcquiredError:
    return SemaphoreNotAcquiredError(f"semaphore {key!r} has all {limit} slots held", key, limit)


def _who(task: Task | None) -> str:
    """``"Task <name>[<id>]: "`` for log lines about a task's run (Celery's own wording)."""
    return "" if task is None else f"Task {task.name}[{task.request.id}]: "


def _task_metadata(task: Task) -> dict[str, Any]:
    request = task.request
    return {"task_id": request.id, "task_name": task.name, "worker": request.hostname}


def _renew_failed(task: Task | None, slot: Slot, template: str) -> Callable[[BaseException], None]:
    def report(error: BaseException) -> None:
        logger.warning(
            "%ssemaphore %r: a renewal failed and will be retried: %s", _who(task), slot.key, error
        )
        semaphore_renew_failed.send(
            sender=task, key=slot.key, limit=slot.limit, template=template, slot=slot, error=error
        )

    return report


def _lease_lost(task: Task | None, slot: Slot, template: str) -> None:
    reason = slot.lease_lost_error().message
    logger.error("%s%s", _who(task), reason)
    semaphore_lease_lost.send(
        sender=task, key=slot.key, limit=slot.limit, template=template, slot=slot, reason=reason
    )
    send_event(task, "lost", key=slot.key, limit=slot.limit, reason=reason)
    if task is not None:
        bump(task.app, task.request.hostname, "lease_lost")


def _shed(task: Task, policy: Policy, key: str, limit: int, template: str, reason: str) -> NoReturn:
    """Publish the running task again with a countdown and end this run in state RETRY.

    The RETRY state is stored *before* the message is published, and the run then ends with
    ``Ignore`` so that Celery stores nothing more for it. Ending with ``Retry`` instead
    would have Celery store RETRY after publishing, and a re-run quick enough to finish
    first would have its SUCCESS overwritten (the result backend's check for SUCCESS and its
    write are two steps): ``result.get()`` would then wait forever on a task that succeeded.
    Celery's ``task_retry`` signal and ``on_retry`` hook therefore do not fire for a shed;
    :data:`~celery_semaphore.signals.semaphore_shed` does.

    Raises:
        celery.exceptions.Ignore: always, after storing RETRY and publishing.
        SemaphoreNotAcquiredError: the shed budget (count or time) is spent; nothing is
            published and the task fails.
    """
    request = task.request
    headers = retry_headers(request)
    attempt = request.retries or 0
    same_attempt = headers.get(SHED_ATTEMPT_HEADER) == attempt
    sheds = int(headers.get(SHEDS_HEADER) or 0) if same_attempt else 0
    first = float(headers.get(FIRST_SHED_HEADER) or time.time()) if same_attempt else time.time()
    spent = ""
    if policy.shed_max_retries is not None and sheds >= policy.shed_max_retries:
        spent = f"shed {sheds} times (shed_max_retries={policy.shed_max_retries})"
    elif policy.shed_timeout is not None and time.time() - first >= policy.shed_timeout:
        spent = f"shed for {time.time() - first:.1f}s (shed_timeout={policy.shed_timeout:g})"
    if spent:
        raise SemaphoreNotAcquiredError(
            f"semaphore {key!r} (limit {limit}): {reason}; task {request.id} {spent}",
            key,
            limit,
        )
    delay = countdown(policy, sheds, random.random())
    headers.update(
        {SHEDS_HEADER: sheds + 1, FIRST_SHED_HEADER: first, SHED_ATTEMPT_HEADER: attempt}
    )
    if not (task.ignore_result or getattr(request, "ignore_result", False)):
        with contextlib.suppress(NotImplementedError):  # no result backend configured
            task.backend.mark_as_retry(request.id, None, request=request)
    task.signature_from_request(request, countdown=delay, headers=headers).apply_async()
    logger.info(
        "%ssemaphore %r (limit %d): shed (%s), runs again in %.2fs",
        _who(task),
        key,
        limit,
        reason,
        delay,
    )
    semaphore_shed.send(
        sender=task,
        key=key,
        limit=limit,
        template=template,
        countdown=delay,
        sheds=sheds + 1,
        reason=reason,
    )
    send_event(task, "shed", key=key, limit=limit, countdown=delay, sheds=sheds + 1, reason=reason)
    bump(task.app, request.hostname, "shed")
    raise Ignore()
