"""Run a task's body under a semaphore slot: the part of the Celery glue that acts.

:class:`SemaphoreTask` and :func:`bounded` both build one :class:`Runner` per task and put
its :meth:`Runner.wrap` around the task's ``run``. Celery calls ``run`` on every path (the
``celery worker`` tracer, in-process test workers, ``apply()``/eager mode and a direct
``task(...)`` call), so wrapping ``run`` rather than overriding ``Task.__call__`` bounds each of
them the same way, and its ``finally`` runs before Celery stores a result, retries, ignores or
rejects.

How a run goes:

* In a worker, a run that finds every slot held is, by default (``on_full="queue"``),
  *parked* in the key's waiting room with its message (see :mod:`.waiting_room`) and ends with
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

import contextlib
import functools
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, NoReturn

from celery import Celery, Task
from celery._state import get_current_app, get_current_task
from celery.signals import worker_process_init

from ..core import heartbeat
from ..core import validation as check
from ..core.admin import DEFAULT_PREFIX
from ..core.feedback import BackOff
from ..core.group import SlotGroup
from ..core.refusals import is_paused, not_acquired
from ..core.semaphore import Semaphore
from ..core.slot import Slot
from ..errors import (
    Refusal,
    SemaphoreBackendError,
    SemaphoreLeaseLostError,
    SemaphoreNotAcquiredError,
    SemaphoreValidationError,
)
from .asks import Ask, ask_for, take
from .body import run_body
from .current import UNBOUNDED
from .keys import KeySet, KeyTemplate
from .limits import HeadStartSpec, LimitSpec, WeightSpec
from .policy import OPTION_NAMES, POLICY_FIELDS, Policy, check_options, warn_if_deprecated
from .settings import app_settings, client_for, policy_and_limits, task_options, task_policy
from .shedding import BACK_OFFS_HEADER, first_asked, shed
from .signals import Names, report_back_off, report_refusal
from .waiting_room.handoffs import claim_or_end, is_give_up, is_handoff, publisher_for
from .waiting_room.parking import give_up_or_end, park_or_take
from .waiting_room.queues import broadcast_queue_of, broadcast_refusal

logger = logging.getLogger(__name__)


class Bound(NamedTuple):
    """What a :class:`Runner` resolved for one app: the semaphore, the effective policy and
    the limit option (the task's own, else its ``app.conf.semaphores`` declaration's)."""

    semaphore: Semaphore
    policy: Policy
    limits: LimitSpec


class Runner:
    """A task body's semaphore: its key, limit and policy options, and how to run under it.

    Args:
        fn (Callable[..., Any]): the body, used to check a key template against.
        semaphore (str | Callable[..., str]): the key option (see :class:`KeyTemplate`).
        limit (int | Callable[..., int] | Mapping[str, int] | None): slots per key, or how
            to compute them per run (see :class:`~.limits.LimitSpec`); None: the limit that
            ``app.conf.semaphores`` declares for ``semaphore``.
        options (Mapping[str, Any]): task-level policy options (names as in
            :class:`~celery_semaphore.integration.policy.Policy`); None values fall through
            to the semaphore's declaration in ``app.conf.semaphores``, then to the app's
            settings.
        app (Celery | None): the app whose settings apply when the body runs outside a task.
        redis (redis.Redis | str | None): the Redis to use instead of the app's
            ``semaphore_url``.
        retries (int): for a plain function call only: further attempts when all slots
            are held (0: fail fast).
        retry_delay (float): for a plain function call only: seconds between attempts.
        weight (int | Callable[..., int] | None): units of the limit each run takes, or a
            callable of the task's arguments returning them (:class:`~.limits.WeightSpec`).
        fair_by (str | Callable[..., str] | None): the tenant of each run for fair turns, a
            template or callable as for ``semaphore``: runs waiting in the room take turns
            across tenants (see :meth:`WaitingRoom.park`); None: arrival order.
        head_start (float | Callable[..., float] | None): each run's priority in the room
            (see :class:`~.limits.HeadStartSpec`); None: 0.

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
        weight: object = None,
        fair_by: object = None,
        head_start: object = None,
    ) -> None:
        unknown = sorted(set(options) - set(POLICY_FIELDS))
        if unknown:
            raise check.unknown_option(unknown[0], OPTION_NAMES)
        if semaphore is None:
            raise SemaphoreValidationError("semaphore option is required (the key to bound by)")
        self.template: KeyTemplate | KeySet
        if isinstance(semaphore, (list, tuple)):  # several keys, each with its own limit
            if limit is not None:
                raise SemaphoreValidationError(
                    "semaphore lists each key's limit: [(key, limit), ...]; give no limit="
                )
            self.template = KeySet(semaphore, fn)
            self.limits: LimitSpec | None = self.template.entries[0][1]
        else:
            self.template = KeyTemplate(semaphore, fn)
            self.limits = None if limit is None else LimitSpec(limit)
        self.weights = WeightSpec(weight)
        for name, value in (("fair_by", fair_by), ("head_start", head_start),
                            ("rate", options.get("rate"))):  # fmt: skip
            if value is not None and isinstance(self.template, KeySet):
                raise SemaphoreValidationError(f"{name} takes one key; give one semaphore key")
        self.fair = None if fair_by is None else KeyTemplate(fair_by, fn)
        self.head_start = HeadStartSpec(head_start)
        self.options = {k: v for k, v in options.items() if v is not None}
        check_options(self.options)  # each given option, now; together at bind, below
        if app is not None and not isinstance(app, Celery):
            raise SemaphoreValidationError(f"app must be a Celery app or None, got {app!r}")
        self.app = app
        self.policy_and_limits(app, settings=False)  # a missing limit or a misfit fails now
        self.redis = redis
        self.retries = check.check_retries(retries)
        self.retry_delay = check.check_delay(retry_delay)
        self._lock = threading.Lock()
        # Weakly keyed by app: an app that is collected takes its Semaphore with it, and a
        # new app at the same address is never handed the old one.
        self._resolved: weakref.WeakKeyDictionary[Celery, Bound] = weakref.WeakKeyDictionary()
        self._unbound: Bound | None = None

    def __repr__(self) -> str:
        limit = "declared" if self.limits is None else self.limits.source
        return f"<Runner {self.template.source!r} limit={limit} options={self.options}>"

    def policy_and_limits(
        self, app: Celery | None, settings: bool = True
    ) -> tuple[Policy, LimitSpec]:
        """The effective policy and limit option of runs under ``app``, without making a
        semaphore (see :func:`.settings.policy_and_limits`)."""
        several = self.template.sources if isinstance(self.template, KeySet) else ()
        source, options, limits = self.template.source, self.options, self.limits
        return policy_and_limits(app, source, options, limits, settings, several)

    def resolve(self, app: Celery | None) -> Bound:
        """The semaphore, the effective policy and the limit option for runs under ``app``
        (cached).

        With no app (a plain call of a function given ``redis=``), the built-in defaults
        stand in for the app's settings.

        Raises:
            SemaphoreValidationError: an app setting is invalid, conflicts with this task's
                options (say an app-wide heartbeat above half the task's lease), or the task
                gives no limit and ``app.conf.semaphores`` declares none for it.
        """
        found = self._unbound if app is None else self._resolved.get(app)
        if found is not None:
            return found
        with self._lock:
            found = self._unbound if app is None else self._resolved.get(app)
            if found is None:
                policy, limits = self.policy_and_limits(app)
                prefix = DEFAULT_PREFIX if app is None else app_settings(app).prefix
                client = self.redis if self.redis is not None else client_for(app)
                semaphore = Semaphore(
                    client, limits.adaptive or limits.default, policy.lease, prefix,
                    claim_timeout=policy.claim_timeout, handoff_grace=policy.handoff_grace,
                    on_handoff=None if app is None else publisher_for(app), rate=policy.rates,
                    max_cool_down=policy.max_cool_down,
                )  # fmt: skip
                found = Bound(semaphore, policy, limits)
                warn_if_deprecated(policy, self.template.source)
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
        # The class attribute is run_function()'s answer for a plain function or a
        # staticmethod, without getattr_static's walk of the MRO on every run.
        if task is None or getattr(type(task), "run", None) is not wrapper:
            return self._call_plain(fn, args, kwargs)
        request = task.request
        if request.is_eager or request.called_directly:
            return self._call_waiting(task, fn, args, kwargs)
        return self._call_in_worker(task, request, fn, args, kwargs)

    def keys_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[str]:
        """Every key a call with these arguments holds a slot of."""
        if isinstance(self.template, KeySet):
            return self.template.render_each(args, kwargs)
        return [self.template.render(args, kwargs)]

    # -- the three modes ---------------------------------------------------------------

    def _call_plain(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
        app = self.app if self.app is not None or self.redis is not None else get_current_app()
        bound = self.resolve(app)
        ask = ask_for(self.template, bound.limits, self.weights, args, kwargs,
                      rates=bound.policy.rates)  # fmt: skip
        names = Names.of(ask.keys, self.template.sources)
        started = time.monotonic()
        slot = take(bound.semaphore, ask, retries=self.retries, retry_delay=self.retry_delay)
        if slot is None:
            paused = is_paused(bound.semaphore.admin, ask.keys[0])
            raise report_refusal(None, not_acquired(ask.key, ask.limit, paused=paused), names)
        waited = time.monotonic() - started
        return run_body(None, slot, bound.policy, waited, names, fn, args, kwargs)

    def _call_waiting(self, task: Task, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        semaphore, policy, _ = bound = self.resolve(task.app)
        ask = ask_for(self.template, bound.limits, self.weights, args, kwargs,
                      rates=bound.policy.rates)  # fmt: skip
        names = Names.of(ask.keys, self.template.sources)
        budget = policy.wait_budget()
        started = time.monotonic()
        back_offs = 0
        metadata = {"task_id": task.request.id, "task_name": task.name,
                    "worker": task.request.hostname}  # fmt: skip
        while True:  # a run that backs off waits for a slot again, past the cool-down
            slot = take(semaphore, ask, wait=budget, metadata=metadata)
            if slot is None:
                raise report_refusal(
                    task,
                    SemaphoreNotAcquiredError(
                        f"semaphore {ask.key!r} had all {ask.limit} slots held for {budget:g}s "
                        f"(task {task.name} run outside a worker waits instead of being shed)",
                        ask.key,
                        ask.limit,
                        Refusal.TIMEOUT,
                    ),
                    names,
                )
            waited = time.monotonic() - started
            try:
                return run_body(task, slot, policy, waited, names, fn, args, kwargs)
            except BackOff as exc:
                back_offs += 1
                self._backed_off(task, policy, names, slot, exc, back_offs)

    def _call_in_worker(
        self, task: Task, request: Any, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        names = Names.of(self.keys_for(args, kwargs), self.template.sources)
        key, started, asked = names.key, time.monotonic(), time.time()
        metadata = {"task_id": request.id, "task_name": task.name, "worker": request.hostname}
        limit = None
        try:
            # A cluster client connects when it is made, so resolving can fail like acquiring.
            semaphore, policy, _ = bound = self.resolve(task.app)
            if policy.on_full != "raise":
                broadcast = broadcast_queue_of(task.app, request.delivery_info)
                if broadcast is not None:  # a copy that parks or sheds would loop
                    raise broadcast_refusal(task.name, broadcast, policy.on_full)
            ask = self._ask_for(task, bound, args, kwargs)
            limit = ask.limit
            if is_give_up(request):
                give_up_or_end(task, semaphore, policy, ask.keys, limit)
            slot = None
            if is_handoff(request):
                slot = claim_or_end(task, semaphore, key, limit, ask.weight, metadata, ask.many)
            if slot is None:
                slot = self._ask(task, semaphore, policy, ask, metadata, names)
        except SemaphoreNotAcquiredError as exc:  # a parked run's budget, or a full room
            raise report_refusal(task, exc, names) from None
        except SemaphoreBackendError as exc:
            policy = task_policy(task.app, task_options(task.app, self.template.source,
                                                        self.options))  # fmt: skip
            if policy.on_full == "raise":
                raise
            self._shed(task, policy, names, limit, f"Redis unreachable: {exc}", Refusal.BACKEND)
        if slot is None:
            if policy.on_full == "raise":
                paused = is_paused(semaphore.admin, key)
                raise report_refusal(task, not_acquired(key, limit, paused=paused), names)
            self._shed(task, policy, names, limit, "all slots held")
        waited = time.monotonic() - started
        first = first_asked(request)
        if first is not None:  # parked or shed before: the wait counts from the first ask
            waited = max(waited, time.time() - first)
        while True:
            try:
                return run_body(task, slot, policy, waited, names, fn, args, kwargs)
            except SemaphoreLeaseLostError:
                if policy.on_lease_lost != "retry" or not slot.lost.is_set():
                    raise
                self._shed(task, policy, names, slot.limit, "slot lost while running")
            except BackOff as exc:
                try:
                    slot = self._back_in_line(task, bound, ask, metadata, names, slot, exc, asked)
                except SemaphoreBackendError as error:  # shed, as a first ask would be
                    if policy.on_full == "raise":
                        raise
                    self._shed(task, policy, names, slot.limit, f"Redis unreachable: {error}",
                               Refusal.BACKEND)  # fmt: skip

    def _ask_for(self, task: Task, bound: Bound, args: Any, kwargs: Any) -> Ask:
        """This run's ask (see :func:`.asks.ask_for`). A run a hand-off started whose limit
        or weight cannot be computed leaves the room first (its reservation goes to the next
        waiter), then fails: it is not handed a slot again."""
        try:
            return ask_for(self.template, bound.limits, self.weights, args, kwargs, self.fair,
                           self.head_start, bound.policy.rates)  # fmt: skip
        except Exception:
            if is_handoff(task.request):
                with contextlib.suppress(SemaphoreBackendError):
                    for key in self.keys_for(args, kwargs):
                        bound.semaphore.room.cancel(key, task.request.id)
            raise

    def _ask(
        self, task: Task, semaphore: Semaphore, policy: Policy, ask: Ask, metadata: Any,
        names: Names,
    ) -> Slot | SlotGroup | None:  # fmt: skip
        """Ask for a slot as ``on_full`` says: a slot (of each key), or None when none is to
        be had (the caller sheds or raises). Parking ends the run (``Ignore``)."""
        if policy.on_full == "queue":
            # One script call whether or not the key is full: take or park.
            return park_or_take(task, semaphore, policy, ask, metadata, names)
        if policy.on_full == "wait":
            asked = time.time()
            slot = take(semaphore, ask, metadata=metadata, wait=policy.wait_timeout)
            if slot is None:
                slot = park_or_take(task, semaphore, policy, ask, metadata, names, asked)
            return slot
        return take(semaphore, ask, metadata=metadata)

    def _backed_off(
        self, task: Task, policy: Policy, names: Names, slot: Slot | SlotGroup, exc: BackOff,
        back_offs: int,
    ) -> float:  # fmt: skip
        """Report a run's ``back_offs``-th back-off (its slot given back with it); returns
        when the cool-down ends (epoch seconds).

        Raises:
            SemaphoreNotAcquiredError: past ``max_back_offs``, or with ``on_full="raise"``.
        """
        ends = report_back_off(task, slot, names, exc.retry_after, back_offs)
        spent = back_offs > policy.max_back_offs
        if spent or policy.on_full == "raise":
            why = (f"backed off {back_offs} times (max_back_offs={policy.max_back_offs})"
                   if spent else f"backed off ({exc}); on_full='raise'")  # fmt: skip
            raise report_refusal(task, SemaphoreNotAcquiredError(
                f"semaphore {names.key!r} (limit {slot.limit}): the provider is over its "
                f"limit; task {task.request.id} {why}", names.key, slot.limit,
                Refusal.BACK_OFF), names) from exc  # fmt: skip
        return ends

    def _back_in_line(
        self, task: Task, bound: Bound, ask: Ask, metadata: Any, names: Names,
        slot: Slot | SlotGroup, exc: BackOff, asked: float,
    ) -> Slot | SlotGroup:  # fmt: skip
        """A worker's run backed off: it waits for a slot again as ``on_full`` says, keeping
        its place (its first ask), its ``retries`` and ``max_retries``: parked in the room
        (``Ignore``), or shed for the cool-down (``"retry"``). Returns a slot only when one
        was free at once (a cool-down already over).

        Raises:
            SemaphoreNotAcquiredError: past ``max_back_offs``, or with ``on_full="raise"``.
            celery.exceptions.Ignore: parked or shed.
        """
        request, policy = task.request, bound.policy
        back_offs = int((request.headers or {}).get(BACK_OFFS_HEADER) or 0) + 1
        ends = self._backed_off(task, policy, names, slot, exc, back_offs)
        # The next message of this run (a shed's, or a parked payload) carries the count.
        request.headers = {**(request.headers or {}), BACK_OFFS_HEADER: back_offs}
        if policy.on_full == "retry":
            self._shed(task, policy, names, slot.limit, "backed off", Refusal.BACK_OFF,
                       at_least=ends - time.time())  # fmt: skip
        return park_or_take(task, bound.semaphore, policy, ask, metadata, names,
                            first_asked(request) or asked)  # fmt: skip

    def _shed(
        self, task: Task, policy: Policy, names: Names, limit: int | None, reason: str,
        refusal: Refusal | None = None, at_least: float = 0.0,
    ) -> NoReturn:  # fmt: skip
        """Shed the running task (see :func:`.shedding.shed`), or fail it when its budget is
        spent (for ``refusal``, if given). ``limit`` is None when it could not be computed
        (Redis was unreachable first)."""
        try:
            shed(task, policy, names, limit, reason, refusal, at_least)
        except SemaphoreNotAcquiredError as exc:
            raise report_refusal(task, exc, names) from None


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


# A prefork pool process runs one task at a time: its runs' releases go inline, which costs
# it less CPU than the release thread (see heartbeat.INLINE).
worker_process_init.connect(lambda **_: setattr(heartbeat, "INLINE", True), weak=False)
