"""How a bounded task acquires, renews, sheds and reacts to loss: the policy, without Celery.

:class:`Policy` holds the task options (each with its app-wide ``semaphore_*`` setting and
default; see :mod:`celery_semaphore.integration.settings` for the table), and
:func:`countdown` the shed backoff. Nothing here imports Celery.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core import validation as check
from ..core.feedback import DEFAULT_MAX_COOL_DOWN, back_off_types
from ..core.handoff import DEFAULT_HANDOFF_GRACE
from ..core.rates import Rate, rates_of
from ..core.semaphore import DEFAULT_LEASE
from ..errors import SemaphoreValidationError

ON_FULL = ("queue", "wait", "retry", "raise")
ON_LEASE_LOST = ("raise", "retry")


@dataclass(frozen=True)
class Policy:
    """How one bounded task acquires, renews, sheds and reacts to loss.

    Attributes:
        lease (float): seconds a slot lives without renewal.
        heartbeat (float | bool | None): renewal interval in seconds; None: lease / 4;
            False: no renewal.
        on_full (str): ``"queue"`` (the default) parks the run in the key's waiting room,
            to be started the moment a slot is released, oldest first; ``"wait"`` first
            waits in the worker up to ``wait_timeout`` seconds for a release to wake it
            (holding its pool process), then parks; ``"retry"``
            re-publishes it with a countdown (shedding); ``"raise"`` fails it with
            :class:`SemaphoreNotAcquiredError`.
        on_lease_lost (str): ``"raise"`` fails the task with
            :class:`SemaphoreLeaseLostError` even if the body returned; ``"retry"`` sheds it
            so it runs again (such sheds count against the shed budget).
        shed_countdown (float): seconds before the first re-run of a shed task.
        shed_backoff (bool): grow the countdown exponentially with each shed, with full jitter
            (a uniform draw between 0 and the exponential value).
        shed_max_countdown (float): cap on any one countdown, seconds. Keep it well under the
            Redis broker's ``visibility_timeout`` (3600 s by default).
        shed_max_retries (int | None): how many times a task may be shed before it fails with
            :class:`SemaphoreNotAcquiredError`; None: no limit. A parked run is not shed, so
            this does not apply to ``"queue"`` (except to the countdown sheds taken when
            Redis is unreachable).
        shed_timeout (float | None): seconds after the first shed after which the task
            fails instead of being shed again; None: no limit. Outside a worker (eager mode,
            a direct call) of a task that sheds or raises, this is how long to wait for a
            slot; when it is None such a call waits up to one lease. Deprecated for a parked
            run: with ``"queue"`` or ``"wait"`` and no ``queue_timeout``, it still bounds
            the wait in the room, with a :class:`DeprecationWarning` once per task.
        queue_timeout (float | None): with ``"queue"`` or ``"wait"``: seconds after the run
            first asked after which it fails instead of waiting on in the room; None: no
            limit. Parked runs are given up by the workers' sweep, so within about 2 seconds
            after the budget. Outside a worker, how long such a task's call waits for a slot
            (one lease when unset).
        interrupt (bool): when the slot is lost, raise an exception inside the running body
            (at its next Python bytecode; a body blocked in C code notices when it returns).
        claim_timeout (float): with ``"queue"``: seconds a slot handed to a parked run stays
            reserved for it before the run goes back to the head of the room.
        max_queued (int | None): with ``"queue"``: how many runs may be parked per key; a
            run past that fails with :class:`SemaphoreNotAcquiredError`. None: no limit.
        handoff_grace (float): with ``"queue"``: seconds a slot handed to a parked run is
            kept for it alone; after that a run that asks for a slot in person takes it
            (the passed-over run keeps its place at the head of the room). Lower it to fill
            slots sooner behind a broker backlog, at the cost of arrival order; 0: strict
            order.
        wait_timeout (float): with ``"wait"``: seconds a run waits in the worker before
            it parks (after the ``wait_timeout`` of Sidekiq Enterprise's concurrent limiter).
        rate (RateSpec): the key's start rate or rates, fleet-wide (``"500/m"``, a
            :class:`~celery_semaphore.core.rates.Rate`, or a list of them); a run starts
            only when every rate allows it. In the room (``"queue"``, ``"wait"``) it waits
            there and is handed its slot for the instant the rates allow; otherwise a run
            over the rate is refused as one that found every slot held. None: no rate.
        back_off_on (type[BaseException] | tuple[type[BaseException], ...]): exceptions
            that mean the provider is over its limit (a 429): a body that raises one backs
            off as if it raised :class:`~celery_semaphore.core.feedback.BackOff`. Default:
            none.
        max_back_offs (int): how many times a run may back off before it fails with
            :class:`SemaphoreNotAcquiredError` (reason ``backoff``). Default 10.
        max_cool_down (float): seconds: the longest cool-down a back-off may ask for; a
            longer hint is clamped and logged. Default 300.0.
    """

    lease: float = DEFAULT_LEASE
    heartbeat: float | bool | None = None
    on_full: str = "queue"
    on_lease_lost: str = "raise"
    shed_countdown: float = 1.0
    shed_backoff: bool = True
    shed_max_countdown: float = 60.0
    shed_max_retries: int | None = None
    shed_timeout: float | None = None
    interrupt: bool = False
    claim_timeout: float = 30.0
    max_queued: int | None = None
    handoff_grace: float = DEFAULT_HANDOFF_GRACE
    wait_timeout: float = 5.0
    queue_timeout: float | None = None
    rate: Any = None
    back_off_on: Any = ()
    max_back_offs: int = 10
    max_cool_down: float = DEFAULT_MAX_COOL_DOWN

    def __post_init__(self) -> None:
        check.lease_ms(self.lease)
        check.heartbeat_interval(self.heartbeat, self.lease)
        for name, checker in _CHECKS.items():
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                checker(value, name)
        self.rates  # noqa: B018  (checked now: a bad rate fails at bind, not at a run)

    @functools.cached_property
    def rates(self) -> tuple[Rate, ...]:
        """The rates of the ``rate`` option, checked (see :func:`.rates.rates_of`)."""
        return rates_of(self.rate)

    def with_options(self, options: Mapping[str, Any]) -> Policy:
        """A copy with ``options`` (task options; None values ignored) applied and checked."""
        given = {k: v for k, v in options.items() if v is not None}
        return dataclasses.replace(self, **given)

    @functools.cached_property
    def back_off_types(self) -> tuple[type[BaseException], ...]:
        """The exceptions of the ``back_off_on`` option, checked."""
        return back_off_types(self.back_off_on)

    @property
    def parks(self) -> bool:
        """Whether a run that finds its key full waits in the room (``"queue"``, ``"wait"``)."""
        return self.on_full in ("queue", "wait")

    def queue_budget(self) -> tuple[float | None, str]:
        """A parked run's budget in seconds (None: no limit), and the option it comes from:
        ``queue_timeout``, else the deprecated ``shed_timeout``."""
        if self.queue_timeout is not None or self.shed_timeout is None:
            return self.queue_timeout, "queue_timeout"
        return self.shed_timeout, "shed_timeout"

    def wait_budget(self) -> float:
        """Seconds a call outside a worker may wait for a slot before it raises: the budget
        of the mode, else one lease."""
        budget = self.queue_budget()[0] if self.parks else self.shed_timeout
        return self.lease if budget is None else budget


POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(Policy))


def check_options(options: Mapping[str, Any]) -> None:
    """Check each of ``options`` (policy options, None values ignored) on its own, as a task
    or a declaration gives them: a heartbeat is judged against the lease only when the same
    options give one, since the lease may come from a declaration or an app setting (the
    effective policy is checked whole when a worker starts or a run resolves it).

    Raises:
        SemaphoreValidationError: an option is invalid; the message names it.
    """
    given = {k: v for k, v in options.items() if v is not None}
    one_budget(given)
    given.setdefault("lease", check.MAX_SECONDS)
    Policy().with_options(given)


def warn_if_deprecated(policy: Policy, semaphore: str) -> None:
    """Warn (:class:`DeprecationWarning`) when ``policy`` bounds a parked run's wait by
    ``shed_timeout``, the budget's old name; a task's runner calls this once per app."""
    if policy.parks and policy.queue_budget()[1] == "shed_timeout":
        warnings.warn(
            f"semaphore {semaphore!r}: shed_timeout bounds the wait of a parked run "
            "(on_full='queue' or 'wait') only as a deprecated alias: name it queue_timeout",
            DeprecationWarning,
            stacklevel=3,
        )


def one_budget(options: Mapping[str, Any], where: str = "") -> None:
    """Refuse ``queue_timeout`` and ``shed_timeout`` given together (in the same task
    options, declaration or app settings) with different values: ``shed_timeout`` is the old
    name of a parked run's budget, so the two would be two budgets for one wait.

    Raises:
        SemaphoreValidationError: both are set and differ; ``where`` opens the message.
    """
    queue, shed = options.get("queue_timeout"), options.get("shed_timeout")
    if queue is not None and shed is not None and queue != shed:
        raise SemaphoreValidationError(
            f"{where}queue_timeout={queue!r} and {where}shed_timeout={shed!r} differ: "
            "shed_timeout is the deprecated name of a parked run's budget, so give "
            "queue_timeout alone here (a shed_timeout for countdown sheds may be given "
            "app-wide or in app.conf.semaphores, apart from it)"
        )


def _choice(allowed: tuple[str, ...]) -> Callable[[object, str], None]:
    def choose(value: object, name: str) -> None:
        if value not in allowed:
            raise SemaphoreValidationError(f"{name} must be one of {allowed!r}, got {value!r}")

    return choose


# Each option's check past the lease and heartbeat, in the order they are reported.
_CHECKS: dict[str, Callable[[Any, str], object]] = {
    "on_full": _choice(ON_FULL),
    "on_lease_lost": _choice(ON_LEASE_LOST),
    "shed_countdown": check.check_delay,
    "shed_max_countdown": check.check_delay,
    "shed_backoff": check.check_flag,
    "interrupt": check.check_flag,
    "shed_max_retries": check.check_retries,
    "shed_timeout": check.check_delay,
    "claim_timeout": check.lease_ms,
    "max_queued": check.check_limit,
    "handoff_grace": check.check_delay,
    "wait_timeout": check.check_delay,
    "queue_timeout": check.check_delay,
    "back_off_on": lambda value, _: back_off_types(value),
    "max_back_offs": check.check_retries,
    "max_cool_down": check.lease_ms,
}
# The options None may leave unset (no limit); any other None is refused by its check.
_OPTIONAL = frozenset({"shed_max_retries", "shed_timeout", "max_queued", "queue_timeout"})


OPTION_NAMES = ("semaphore", "limit", "weight", "fair_by", "head_start", *POLICY_FIELDS)
"""Every semaphore option a task or ``@bounded`` takes."""


def countdown(policy: Policy, sheds: int, draw: float) -> float:
    """Seconds to wait before re-running a task shed ``sheds`` times before.

    With backoff: ``draw * min(cap, base * 2**sheds)`` ("full jitter"), where ``draw`` is a
    uniform random number in [0, 1) supplied by the caller. Without: ``min(cap, base)``.
    """
    if not policy.shed_backoff:
        return min(policy.shed_max_countdown, policy.shed_countdown)
    ceiling = policy.shed_countdown * math.pow(2, min(sheds, 32))
    return draw * min(policy.shed_max_countdown, ceiling)
