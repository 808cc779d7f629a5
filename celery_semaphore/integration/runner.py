"""Run a task's body under a semaphore slot: the part of the Celery glue that acts.

:class:`SemaphoreTask` and :func:`bounded` both build one :class:`Runner` per task and put
its :meth:`Runner.wrap` around the task's ``run``. Celery calls ``run`` on every path (the
``celery worker`` tracer, in-process test workers, ``apply()``/eager mode and a direct
``task(...)`` call), so wrapping ``run`` rather than overriding ``Task.__call__`` bounds each of
them the same way, and its ``finally`` runs before Celery stores a result, retries, ignores or
rejects.

How a run goes:

* In a worker, a run that finds every slot held is, by default (``on_full="queue"``),
  *parked* in the key's waiting room with its message (see :mod:`.room`) and ends with
  ``Ignore``; the release that frees a slot hands it to the oldest parked run and publishes
  that run's message again (same id, same ``retries``). ``on_full="wait"`` first waits in
  the worker, then parks; ``"retry"`` *sheds* the run instead: the same message is published
  again with a countdown and the run ends in state RETRY (see :mod:`.shedding`); ``"raise"``
  fails it. A run that cannot reach Redis is shed whatever ``on_full`` says, unless it is
  ``"raise"``. Neither parking nor shedding touches ``request.retries``, so a task's
  ``max_retries`` only ever counts its own retries.
* Outside a worker (eager mode, ``apply()``, a direct call) nothing is published: the run
  waits for a slot up to its budget (woken by the release that frees one), then raises
  :class:`SemaphoreNotAcquiredError`.
* A plain function (not running as a task) fails fast, or retries as ``retries`` says.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from celery import Celery, Task
from celery._state import get_current_app, get_current_task

from ..core import validation as check
from ..core.admin import DEFAULT_PREFIX
from ..core.interrupt import Interrupter
from ..core.semaphore import Semaphore, guard
from ..core.slot import Slot
from ..errors import (
    SemaphoreBackendError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from .current import CURRENT, UNBOUNDED
from .keys import KeyTemplate
from .policy import OPTION_NAMES, POLICY_FIELDS, Policy
from .room import (
    claim_or_end,
    give_up_or_end,
    is_give_up,
    is_handoff,
    park_or_take,
    publisher_for,
)
from .settings import app_settings, client_for, task_policy
from .shedding import first_asked, shed
from .signals import (
    renew_failed_reporter,
    report_lease_lost,
    semaphore_acquired,
    semaphore_refused,
    semaphore_released,
    send_event,
)

logger = logging.getLogger(__name__)


class Runner:
    """A task body's semaphore: its key, limit and policy options, and how to run under it.

    Args:
        fn (Callable[..., Any]): the body, used to check a key template against.
        semaphore (str | Callable[..., str]): the key option (see :class:`KeyTemplate`).
        limit (int): slots per key.
        options (Mapping[str, Any]): task-level policy options (names as in
            :class:`~celery_semaphore.integration.policy.Policy`); None values fall through
            to the app's settings.
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
        self.template = KeyTemplate(semaphore, fn)
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
        # Weakly keyed by app: an app that is collected takes its Semaphore with it, and a
        # new app at the same address is never handed the old one.
        self._resolved: weakref.WeakKeyDictionary[Celery, tuple[Semaphore, Policy]] = (
            weakref.WeakKeyDictionary()
        )
        self._unbound: tuple[Semaphore, Policy] | None = None

    def __repr__(self) -> str:
        return f"<Runner {self.template.source!r} limit={self.limit} options={self.options}>"

    def resolve(self, app: Celery | None) -> tuple[Semaphore, Policy]:
        """The semaphore and the effective policy for runs under ``app`` (cached).

        With no app (a plain call of a function given ``redis=``), the built-in defaults
        stand in for the app's settings.

        Raises:
            SemaphoreValidationError: an app setting is invalid, or conflicts with this
                task's options (say an app-wide heartbeat above half the task's lease).
        """
        found = self._unbound if app is None else self._resolved.get(app)
        if found is not None:
            return found
        with self._lock:
            found = self._unbound if app is None else self._resolved.get(app)
            if found is None:
                policy = task_policy(app, self.options)
                prefix = DEFAULT_PREFIX if app is None else app_settings(app).prefix
                client = self.redis if self.redis is not None else client_for(app)
                semaphore = Semaphore(
                    client,
                    self.limit,
                    policy.lease,
                    prefix,
                    claim_timeout=policy.claim_timeout,
                    on_handoff=None if app is None else publisher_for(app),
                    handoff_grace=policy.handoff_grace,
                )
                found = (semaphore, policy)
                if app is None:
                    self._unbound = found
                else:
                    self._resolved[app] = found
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
        if UNBOUNDED:
            return fn(*args, **kwargs)
        task = get_current_task()
        if task is None or run_function(task)[0] is not wrapper:
            return self._call_plain(fn, args, kwargs)
        request = task.request
        if request.is_eager or request.called_directly:
            return self._call_waiting(task, fn, args, kwargs)
        return self._call_in_worker(task, fn, args, kwargs)

    def key_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The semaphore key for a call with these arguments (see :class:`KeyTemplate`)."""
        return self.template.render(args, kwargs)

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
        started = time.monotonic()
        slot = semaphore.acquire(key, wait=budget, metadata=_task_metadata(task))
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
        metadata = _task_metadata(task)
        try:
            # A cluster client connects when it is made, so resolving can fail like acquiring.
            semaphore, policy = self.resolve(task.app)
            if is_give_up(task.request):
                try:
                    give_up_or_end(task, semaphore, policy, key)
                except SemaphoreNotAcquiredError as exc:
                    raise self._refused(task, exc) from None
            slot = (
                claim_or_end(task, semaphore, key, metadata) if is_handoff(task.request) else None
            )
            if slot is None:
                slot = self._ask(task, semaphore, policy, key, metadata)
        except SemaphoreBackendError as exc:
            policy = task_policy(task.app, self.options)
            if policy.on_full == "raise":
                raise
            self._shed(task, policy, key, f"Redis unreachable: {exc}")
        if slot is None:
            if policy.on_full == "raise":
                raise self._refused(task, _full_error(key, self.limit))
            self._shed(task, policy, key, "all slots held")
        waited = time.monotonic() - started
        first = first_asked(task.request)
        if first is not None:  # parked or shed before: the wait counts from the first ask
            waited = max(waited, time.time() - first)
        try:
            return self._run(task, slot, policy, waited, fn, args, kwargs)
        except SemaphoreLeaseLostError:
            if policy.on_lease_lost != "retry" or not slot.lost.is_set():
                raise
            self._shed(task, policy, key, "slot lost while running")

    def _ask(
        self, task: Task, semaphore: Semaphore, policy: Policy, key: str, metadata: Any
    ) -> Slot | None:
        """Ask for a slot as ``on_full`` says: a slot, or None when all are held (the caller
        sheds or raises). Parking ends the run (``Ignore``)."""
        if policy.on_full == "queue":
            # One script call whether or not the key is full: take or park.
            return park_or_take(task, semaphore, policy, key, metadata, self.template.source)
        if policy.on_full == "wait":
            asked = time.time()
            slot = semaphore.acquire(key, metadata=metadata, wait=policy.wait_timeout)
            if slot is None:
                slot = park_or_take(
                    task, semaphore, policy, key, metadata, self.template.source, asked
                )
            return slot
        return semaphore.acquire(key, metadata=metadata)

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
        template = self.template.source
        semaphore_acquired.send(
            sender=task, key=slot.key, limit=slot.limit, template=template, slot=slot, waited=waited
        )
        send_event(task, "acquired", key=slot.key, limit=slot.limit, waited=waited)
        started = time.monotonic()
        try:
            with guard(slot, interval, renew_failed_reporter(task, slot, template)):
                token = CURRENT.set(slot)
                try:
                    if interrupter is None:
                        return fn(*args, **kwargs)
                    with interrupter:
                        return fn(*args, **kwargs)
                finally:
                    CURRENT.reset(token)
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
                report_lease_lost(task, slot, template)

    def _refused(
        self, task: Task | None, error: SemaphoreNotAcquiredError
    ) -> SemaphoreNotAcquiredError:
        """Report that a run will not get a slot (no shed: it fails); returns ``error``."""
        semaphore_refused.send(
            sender=task,
            key=error.key,
            limit=error.limit,
            template=self.template.source,
            reason=error.message,
        )
        return error

    def _shed(self, task: Task, policy: Policy, key: str, reason: str) -> NoReturn:
        """Shed the running task (see :func:`.shedding.shed`), or fail it when its budget is
        spent."""
        try:
            shed(task, policy, key, self.limit, self.template.source, reason)
        except SemaphoreNotAcquiredError as exc:
            raise self._refused(task, exc) from None


def run_function(task: Any) -> tuple[Any, bool]:
    """The function behind ``run`` of ``task`` (a task or a task class), unwrapped from a
    staticmethod, and whether ``run`` takes the task first (a method, not a staticmethod)."""
    cls = task if isinstance(task, type) else type(task)
    run = inspect.getattr_static(cls, "run", None)
    is_static = isinstance(run, staticmethod)
    return (run.__func__ if is_static else run), not is_static


def runner_of(task: Any) -> tuple[Runner, bool] | None:
    """The :class:`Runner` guarding ``task``'s run, and whether run takes the task first."""
    fn, takes_task = run_function(task)
    found = getattr(fn, "__semaphore__", None)
    return (found, takes_task) if isinstance(found, Runner) else None


def refusal_of(task: Any) -> SemaphoreValidationError | None:
    """The error every run of ``task`` raises because its semaphore options are invalid."""
    error = getattr(run_function(task)[0], "__semaphore_error__", None)
    return error if isinstance(error, SemaphoreValidationError) else None


def _full_error(key: str, limit: int) -> SemaphoreNotAcquiredError:
    return SemaphoreNotAcquiredError(f"semaphore {key!r} has all {limit} slots held", key, limit)


def _task_metadata(task: Task) -> dict[str, Any]:
    request = task.request
    return {"task_id": request.id, "task_name": task.name, "worker": request.hostname}
