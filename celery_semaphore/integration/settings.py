"""Settings: the ``semaphore_*`` keys of ``app.conf``, and per-task options.

Precedence is task option > app setting > built-in default. App settings are read once per app
into a frozen :class:`AppSettings` cached on the app; task options are checked when the task
is bound to its app, so a typo fails at import time rather than on the first run.

======================== ============================ ========== ==========================
task option              app setting                  default    meaning
======================== ============================ ========== ==========================
(none)                   ``semaphore_url``            see below  Redis holding the slots
(none)                   ``semaphore_prefix``         semaphore  key namespace
(none)                   ``semaphores``               {}         semaphores declared by name
(none)                   ``semaphore_flower_set_limit`` True     Flower page may set limits
(none)                   ``semaphore_handoff_priority`` None     hand-offs' message priority
(none)                   ``semaphore_handoff_queues`` True       hand-offs skip the backlog
(none)                   ``semaphore_room_ttl``       86400.0    a room outlives its last touch
(none)                   ``semaphore_journal``        True       journal parked runs per host
(none)                   ``semaphore_sweep_interval`` 2.0        seconds between sweeps of a room
``limit``                (declared, else required)               slots per key (or per run)
``lease``                ``semaphore_lease``          60.0       seconds a slot lives unrenewed
``heartbeat``            ``semaphore_heartbeat``      lease / 4  renewal interval; False: none
``on_full``              ``semaphore_on_full``        "queue"    "queue" (park), "wait" (then
                                                                 park), "retry" (shed), "raise"
``wait_timeout``         ``semaphore_wait_timeout``   5.0        "wait": seconds in the worker
``claim_timeout``        ``semaphore_claim_timeout``  30.0       seconds a hand-off stays reserved
``max_queued``           ``semaphore_max_queued``     None       parked runs per key, then fail
``handoff_grace``        ``semaphore_handoff_grace``  1.0        reserved for its run alone, s
``on_lease_lost``        ``semaphore_on_lease_lost``  "raise"    "raise" or "retry"
``shed_countdown``       ``semaphore_shed_countdown`` 1.0        first shed's countdown, s
``shed_backoff``         ``semaphore_shed_backoff``   True       exponential, full jitter
``shed_max_countdown``   ``semaphore_shed_max_countdown`` 60.0   cap on one countdown, s
``shed_max_retries``     ``semaphore_shed_max_retries``   None   sheds before failing
``shed_timeout``         ``semaphore_shed_timeout``   None       seconds shed, then fail
``queue_timeout``        ``semaphore_queue_timeout``  None       seconds parked, then fail
``interrupt``            ``semaphore_interrupt``      False      stop the body on lease loss
``rate``                 ``semaphore_rate``           None       starts per s/m/h/d, fleet-wide
``back_off_on``          ``semaphore_back_off_on``    ()         exceptions that mean a 429
``max_back_offs``        ``semaphore_max_back_offs``  10         back-offs of a run, then fail
``max_cool_down``        ``semaphore_max_cool_down``  300.0      longest cool-down a hint asks, s
======================== ============================ ========== ==========================

``semaphore_url`` defaults to Celery's broker when that is Redis, else its result backend when
that is Redis, read as Celery reads them (see :mod:`celery_semaphore.integration.store`);
otherwise it must be set.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from celery import Celery

from ..core import validation as check
from ..core.admin import DEFAULT_PREFIX
from ..core.room import DEFAULT_ROOM_TTL
from ..errors import SemaphoreValidationError
from .limits import LimitSpec, declared_semaphores
from .policy import POLICY_FIELDS, Policy, one_budget
from .store import Store, resolve_store
from .waiting_room.journal import Journal, open_journal

DEFAULT_SWEEP_INTERVAL = 2.0
"""Seconds between two sweeps of one waiting room by the whole fleet, unless
``semaphore_sweep_interval`` says otherwise."""
MAX_SWEEP_INTERVAL = 3600.0


@dataclass(frozen=True)
class AppSettings:
    """The ``semaphore_*`` settings of one Celery app, resolved once.

    Attributes:
        store (Store): the Redis holding the slots (see :func:`resolve_store`).
        prefix (str): key namespace.
        policy (Policy): app-wide defaults for the task options.
        declared (Mapping[str, Mapping[str, Any]]): ``app.conf.semaphores``: the options
            (``limit`` and any policy option) of each semaphore declared by name, which the
            tasks that name it as their ``semaphore`` inherit.
        flower_set_limit (bool): ``semaphore_flower_set_limit``: whether the Flower page
            offers to set and clear live limits (False: it only shows them).
        handoff_priority (int | None): ``semaphore_handoff_priority``: the message priority
            a handed-off run is published with (None: the run's own), so that the broker can
            deliver hand-offs ahead of a backlog sent at a lower priority.
        handoff_queues (bool): ``semaphore_handoff_queues``: whether workers consume a
            hand-off queue beside each of their queues, so that hand-offs do not wait behind
            a backlog (see :mod:`~celery_semaphore.integration.waiting_room.queues`).
        room_ttl (float): ``semaphore_room_ttl``: seconds a waiting room outlives its last
            touch (a park, claim, release into it or sweep of it): a room whose fleet is gone
            for that long expires, one that is still drained or swept never does.
        journal (str | None): ``semaphore_journal``: the directory of the hosts' journals of
            parked runs (see :mod:`~celery_semaphore.integration.waiting_room.journal`);
            "" for the default places, None when it is turned off (``False``).
        sweep_interval (float): ``semaphore_sweep_interval``: seconds between two sweeps of
            one waiting room by the whole fleet, and between a worker's checks of its store
            (see :mod:`~celery_semaphore.integration.waiting_room.sweeps`).
    """

    store: Store
    prefix: str
    policy: Policy
    declared: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    flower_set_limit: bool = True
    handoff_priority: int | None = None
    handoff_queues: bool = True
    room_ttl: float = DEFAULT_ROOM_TTL
    journal: str | None = None
    sweep_interval: float = DEFAULT_SWEEP_INTERVAL

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
    known = {"semaphore_url", "semaphore_prefix",
             *(f"semaphore_{n}" for n in (*_SETTINGS, *POLICY_FIELDS))}  # fmt: skip
    unknown = sorted(k for k in conf if k.startswith("semaphore_") and k not in known)
    if unknown:
        raise SemaphoreValidationError(
            f"unknown setting(s) {', '.join(unknown)}; celery-semaphore knows {sorted(known)}"
        )
    store = resolve_store(app)
    prefix = conf.get("semaphore_prefix") or DEFAULT_PREFIX
    check.check_key(prefix, "semaphore_prefix")
    options = {name: conf.get(f"semaphore_{name}") for name in POLICY_FIELDS}
    one_budget(options, "app.conf.semaphore_")
    try:
        policy = Policy().with_options(options)
    except SemaphoreValidationError as exc:
        raise SemaphoreValidationError(f"app.conf.semaphore_{exc}", None, None) from None
    declared = declared_semaphores(conf.get("semaphores"))
    given = {name: conf.get(f"semaphore_{name}") for name in _SETTINGS}
    checked: dict[str, Any] = {
        name: checker(default if given[name] is None else given[name], f"app.conf.semaphore_{name}")
        for name, (default, checker) in _SETTINGS.items()
    }
    settings = AppSettings(store=store, prefix=prefix, policy=policy, declared=declared, **checked)
    app._semaphore_settings = settings
    return settings


def _room_ttl(value: object, where: str) -> float:
    """``semaphore_room_ttl`` checked: positive seconds, at most 366 days."""
    check.lease_ms(value, where)
    return float(value)  # type: ignore[arg-type]


def _sweep_interval(value: object, where: str) -> float:
    """``semaphore_sweep_interval`` checked: seconds from 0.05 to 3600."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0.05 <= value <= MAX_SWEEP_INTERVAL
    ):
        raise SemaphoreValidationError(
            f"{where} must be a number of seconds from 0.05 to {MAX_SWEEP_INTERVAL:g}, got "
            f"{value!r}"
        )
    return float(value)


def _journal(value: object, where: str) -> str | None:
    """``semaphore_journal`` checked: True ("": the default places, see
    :func:`~.waiting_room.journal.default_directories`), False (off), or a directory (a str
    or path-like)."""
    if isinstance(value, bool):
        return "" if value else None
    if isinstance(value, (str, os.PathLike)) and str(value):
        return str(value)
    raise SemaphoreValidationError(f"{where} must be True, False or a directory, got {value!r}")


def _priority(value: object, where: str) -> int | None:
    """``semaphore_handoff_priority`` checked: None, or an int from 0 to 255 (AMQP's range;
    kombu's Redis transport uses 0 to 9, 0 first)."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255
    ):
        raise SemaphoreValidationError(
            f"{where} must be None or an int from 0 to 255, got {value!r}"
        )
    return value


# The app-wide settings past the store, the prefix, the policy and the declarations: each
# one's value when it is unset (None), and its check, which answers the value to keep; in
# the order they are checked. A flag must be a real bool, since "false" from an
# environment-driven config would otherwise read True.
_SETTINGS: dict[str, tuple[object, Callable[[Any, str], object]]] = {
    "handoff_priority": (None, _priority),
    "flower_set_limit": (True, check.check_flag),
    "handoff_queues": (True, check.check_flag),
    "room_ttl": (DEFAULT_ROOM_TTL, _room_ttl),
    "journal": (True, _journal),
    "sweep_interval": (DEFAULT_SWEEP_INTERVAL, _sweep_interval),
}


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


def journal_for(app: Celery) -> Journal | None:
    """This host's journal of the app's parked runs (found once per app and process, or
    inherited from the process that forked it), or None when ``semaphore_journal`` is False
    or no journal can be written (said once, see
    :func:`~.waiting_room.journal.open_journal`).

    Raises:
        SemaphoreValidationError: as :func:`app_settings`.
    """
    settings = app_settings(app)
    if settings.journal is None:
        return None
    if "_semaphore_journal" not in app.__dict__:
        app.__dict__["_semaphore_journal"] = open_journal(
            settings.journal, settings.store.url, settings.prefix
        )
    return cast("Journal | None", app.__dict__["_semaphore_journal"])


def forget(app: Celery, task_id: str) -> None:
    """Strike run ``task_id`` out of this host's journal of the app's parked runs (it left
    the room, by a claim, a give-up, a revoke or an expiry), if there is a journal."""
    if (journal := journal_for(app)) is not None:
        journal.forget(task_id)


def declared_for(app: Celery | None, name: str, settings: bool = True) -> Mapping[str, Any]:
    """The options ``app.conf.semaphores`` declares for the semaphore ``name`` (a task's
    ``semaphore`` option as written); empty when it declares none, or with no app. With
    ``settings`` False, ``app.conf.semaphores`` is read on its own, not with (and without
    checking) the app's other ``semaphore_*`` settings.

    Raises:
        SemaphoreValidationError: an app setting is invalid.
    """
    if app is None:
        return {}
    if not settings:
        return declared_semaphores(app.conf.get("semaphores")).get(name, {})
    return app_settings(app).declared.get(name, {})


def task_policy(app: Celery | None, options: Mapping[str, Any]) -> Policy:
    """The effective policy of a task with ``options`` under ``app`` (task option > app
    setting > default); with no app, the defaults stand in for the app's settings.

    Raises:
        SemaphoreValidationError: an app setting is invalid, or conflicts with an option.
    """
    defaults = Policy() if app is None else app_settings(app).policy
    return defaults.with_options(options)


def task_options(
    app: Celery | None, name: str, options: Mapping[str, Any], settings: bool = True
) -> dict[str, Any]:
    """The policy options of a task whose ``semaphore`` option is ``name``: its own
    ``options``, over those ``app.conf.semaphores`` declares for ``name`` (read on its own
    with ``settings`` False; see :func:`declared_for`).

    Raises:
        SemaphoreValidationError: an app setting is invalid.
    """
    declared = declared_for(app, name, settings)
    return {**{k: v for k, v in declared.items() if k in POLICY_FIELDS}, **options}


def policy_and_limits(
    app: Celery | None,
    name: str,
    options: Mapping[str, Any],
    limits: LimitSpec | None,
    settings: bool = True,
    several: Sequence[str] = (),
) -> tuple[Policy, LimitSpec]:
    """The effective policy and the limit option of a task whose ``semaphore`` option is
    ``name``, whose own policy options are ``options`` and limit option ``limits`` (None:
    the one ``app.conf.semaphores`` declares). With ``settings`` False, the app's settings
    are not resolved (binding a task checks its options so, before the app's settings, which
    a worker checks when it starts): ``app.conf.semaphores`` and the app's
    ``semaphore_lease`` and ``semaphore_heartbeat`` are read as they stand, so that a
    heartbeat is judged against the lease that will apply, and the policy returned holds
    only the options so combined. ``several`` are the keys of a run of several keys, as
    written.

    Raises:
        SemaphoreValidationError: an app setting is invalid, conflicts with ``options``, or
            ``limits`` is None and no declaration gives a limit; or ``app.conf.semaphores``
            declares a rate for one of ``several`` (a run of several keys is not held to
            rates: refused rather than let such runs pass the rate unseen).
    """
    for key in several:
        if declared_for(app, key, settings).get("rate") is not None:
            raise SemaphoreValidationError(
                f"semaphore {key!r} declares a rate in app.conf.semaphores, and a run of "
                "several keys is not held to rates: bound this task by that key alone, or "
                "declare the rate on a key of its own"
            )
    if limits is None:
        declared = declared_for(app, name, settings).get("limit")
        if declared is None:
            raise SemaphoreValidationError(
                f"semaphore {name!r}: limit is required: give the task limit=..., or declare "
                "the semaphore in app.conf.semaphores (with @bounded, also give app=, so "
                "that the declaration can be found)"
            )
        limits = LimitSpec(declared)
    if not settings:
        conf: Mapping[str, Any] = {} if app is None else app.conf
        timing = {f: conf.get(f"semaphore_{f}") for f in ("lease", "heartbeat")}
        combined = {**timing, **task_options(app, name, options, settings=False)}
        return Policy().with_options(combined), limits
    return task_policy(app, task_options(app, name, options)), limits
