"""Settings: the ``semaphore_*`` keys of ``app.conf``, and per-task options.

Precedence is task option > app setting > built-in default. App settings are read once per app
into a frozen :class:`AppSettings` cached on the app; task options are checked when the task
is bound to its app, so a typo fails at import time rather than on the first run.

======================== ============================ ========== ==========================
task option              app setting                  default    meaning
======================== ============================ ========== ==========================
(none)                   ``semaphore_url``            see below  Redis holding the slots
(none)                   ``semaphore_prefix``         semaphore  key namespace
``limit``                (none: required per task)               slots per key
``lease``                ``semaphore_lease``          60.0       seconds a slot lives unrenewed
``heartbeat``            ``semaphore_heartbeat``      lease / 4  renewal interval; False: none
``on_full``              ``semaphore_on_full``        "retry"    "retry" (shed) or "raise"
``on_lease_lost``        ``semaphore_on_lease_lost``  "raise"    "raise" or "retry"
``shed_countdown``       ``semaphore_shed_countdown`` 1.0        first shed's countdown, s
``shed_backoff``         ``semaphore_shed_backoff``   True       exponential, full jitter
``shed_max_countdown``   ``semaphore_shed_max_countdown`` 60.0   cap on one countdown, s
``shed_max_retries``     ``semaphore_shed_max_retries``   None   sheds before failing
``shed_timeout``         ``semaphore_shed_timeout``   None       seconds of shedding, then fail
``interrupt``            ``semaphore_interrupt``      False      stop the body on lease loss
======================== ============================ ========== ==========================

``semaphore_url`` defaults to Celery's broker when that is Redis, else its result backend when
that is Redis, read as Celery reads them (see :mod:`celery_semaphore.store`); otherwise it
must be set.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from . import _validation as check
from .errors import SemaphoreValidationError
from .semaphore import DEFAULT_LEASE, DEFAULT_PREFIX
from .store import Store, resolve_store

ON_FULL = ("retry", "raise")
ON_LEASE_LOST = ("raise", "retry")


@dataclass(frozen=True)
class Policy:
    """How one bounded task acquires, renews, sheds and reacts to loss.

    Attributes:
        lease (float): seconds a slot lives without renewal.
        heartbeat (float | bool | None): renewal interval in seconds; None: lease / 4;
            False: no renewal.
        on_full (str): ``"retry"`` re-publishes the task with a countdown (shedding);
            ``"raise"`` fails it with :class:`SemaphoreNotAcquiredError`.
        on_lease_lost (str): ``"raise"`` fails the task with
            :class:`SemaphoreLeaseLostError` even if the body returned; ``"retry"`` sheds it
            so it runs again (such sheds count against the shed budget).
        shed_countdown (float): seconds before the first re-run of a shed task.
        shed_backoff (bool): grow the countdown exponentially with each shed, with full jitter
            (a uniform draw between 0 and the exponential value).
        shed_max_countdown (float): cap on any one countdown, seconds. Keep it well under the
            Redis broker's ``visibility_timeout`` (3600 s by default).
        shed_max_retries (int | None): how many times a task may be shed before it fails with
            :class:`SemaphoreNotAcquiredError`; None: no limit.
        shed_timeout (float | None): seconds after the first shed after which the task fails
            instead of being shed again; None: no limit. Outside a worker (eager mode, a
            direct call) this is how long to wait for a slot; when it is None such a call
            waits up to one lease.
        interrupt (bool): when the slot is lost, raise an exception inside the running body
            (at its next Python bytecode; a body blocked in C code notices when it returns).
    """

    lease: float = DEFAULT_LEASE
    heartbeat: float | bool | None = None
    on_full: str = "retry"
    on_lease_lost: str = "raise"
    shed_countdown: float = 1.0
    shed_backoff: bool = True
    shed_max_countdown: float = 60.0
    shed_max_retries: int | None = None
    shed_timeout: float | None = None
    interrupt: bool = False

    def __post_init__(self) -> None:
        check.lease_ms(self.lease)
        check.heartbeat_interval(self.heartbeat, self.lease)
        _choice("on_full", self.on_full, ON_FULL)
        _choice("on_lease_lost", self.on_lease_lost, ON_LEASE_LOST)
        check.check_delay(self.shed_countdown, "shed_countdown")
        check.check_delay(self.shed_max_countdown, "shed_max_countdown")
        _flag("shed_backoff", self.shed_backoff)
        _flag("interrupt", self.interrupt)
        if self.shed_max_retries is not None:
            check.check_retries(self.shed_max_retries, "shed_max_retries")
        if self.shed_timeout is not None:
            check.check_delay(self.shed_timeout, "shed_timeout")

    def with_options(self, options: Mapping[str, Any]) -> Policy:
        """A copy with ``options`` (task options; None values ignored) applied and checked."""
        given = {k: v for k, v in options.items() if v is not None}
        return dataclasses.replace(self, **given)

    def wait_budget(self) -> float:
        """Seconds a call outside a worker may wait for a slot before it raises."""
        if self.shed_timeout is not None:
            return self.shed_timeout
        return self.lease


POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(Policy))


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SemaphoreValidationError(f"{name} must be one of {allowed!r}, got {value!r}")


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SemaphoreValidationError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class AppSettings:
    """The ``semaphore_*`` settings of one Celery app, resolved once.

    Attributes:
        store (Store): the Redis holding the slots (see :func:`resolve_store`).
        prefix (str): key namespace.
        policy (Policy): app-wide defaults for the task options.
    """

    store: Store
    prefix: str
    policy: Policy

    @property
    def url(self) -> str:
        """The store's URL, password masked."""
        return self.store.url


def app_settings(app: Celery) -> AppSettings:
    """The app's resolved settings, computed on first use and cached on the app.

    Raises:
        SemaphoreValidationError: a ``semaphore_*`` setting is invalid, or no Redis URL can be
            found; the message names the setting.
    """
    cached = getattr(app, "_semaphore_settings", None)
    if isinstance(cached, AppSettings):
        return cached
    conf = app.conf
    known = {"semaphore_url", "semaphore_prefix", *(f"semaphore_{n}" for n in POLICY_FIELDS)}
    unknown = sorted(k for k in conf if k.startswith("semaphore_") and k not in known)
    if unknown:
        raise SemaphoreValidationError(
            f"unknown setting(s) {', '.join(unknown)}; celery-semaphore knows {sorted(known)}"
        )
    store = resolve_store(app)
    prefix = conf.get("semaphore_prefix") or DEFAULT_PREFIX
    check.check_key(prefix, "semaphore_prefix")
    options = {name: conf.get(f"semaphore_{name}") for name in POLICY_FIELDS}
    try:
        policy = Policy().with_options(options)
    except SemaphoreValidationError as exc:
        raise SemaphoreValidationError(f"app.conf.semaphore_{exc}", None, None) from None
    settings = AppSettings(store=store, prefix=prefix, policy=policy)
    app._semaphore_settings = settings
    return settings


def client_for(app: Celery) -> redis.Redis:
    """The redis-py client for the app's semaphore store, made once per app.

    Sharing it across a fork is safe: redis-py gives a child process fresh connections.

    Raises:
        SemaphoreValidationError: as :func:`app_settings`, or the store's client options
            cannot make a connection.
        SemaphoreBackendError: a ``redis+cluster://`` store cannot be reached.
    """
    settings = app_settings(app)
    client: redis.Redis | None = app.__dict__.get("_semaphore_client")
    if client is None:
        client = app.__dict__["_semaphore_client"] = settings.store.connect()
    return client


def countdown(policy: Policy, sheds: int, draw: float) -> float:
    """Seconds to wait before re-running a task shed ``sheds`` times before.

    With backoff: ``draw * min(cap, base * 2**sheds)`` ("full jitter"), where ``draw`` is a
    uniform random number in [0, 1) supplied by the caller. Without: ``min(cap, base)``.
    """
    if not policy.shed_backoff:
        return min(policy.shed_max_countdown, policy.shed_countdown)
    ceiling = policy.shed_countdown * math.pow(2, min(sheds, 32))
    return draw * min(policy.shed_max_countdown, ceiling)
