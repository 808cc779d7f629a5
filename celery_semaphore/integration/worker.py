"""The worker's side: a bootstep that checks the bounded tasks at start-up, answers ``celery
inspect semaphores`` and ``inspect stats``, and frees the slot of a run whose process died.

Dead runs: a prefork child killed by SIGKILL, the OOM killer or a hard time limit cannot
release its slot; without help the slot stays held until its lease runs out. The worker's
main process learns of such deaths (Celery sends ``task_failure`` with ``WorkerLostError`` or
``TimeLimitExceeded`` there, and ``task_revoked`` after ``revoke(terminate=True)``), so the
step's :class:`DeadRunReleaser` finds the dead run's holder in Redis (by task id and host) and
releases it once the holder's process has exited, rechecking on the worker's timer. When the
message is requeued instead (``acks_late`` with ``reject_on_worker_lost``) Celery sends no
signal, and the slot lapses within one lease.

The upkeep: the worker's main loop (kombu's event loop and timer) receives messages and starts
runs, and a round trip there holds up every message behind it. So the bootstep starts one
daemon thread per worker (:class:`Upkeep`), in its main process (a prefork worker's pool
processes have none), which:

- every ``semaphore_sweep_interval`` seconds (2 s), checks that the store answers
  (:class:`~.store_watch.StoreWatch`) and, for an app with a queueing task, does the
  sweeper's :meth:`~.waiting_room.sweeps.RoomSweeper.tick` (the journal keeper, the
  revoked ids, the fleet's periodic scan);
- in between, takes the rooms due for a sweep a page at a time, and sweeps them: at once
  again while a page comes back full, else once the next room is due (no sooner than an
  eighth, no later than a quarter of an interval, so that a room is swept within about a
  quarter of an interval of its time, and each worker asks the index at most about 8 times
  an interval when nothing is due).

The thread never raises out (each step logs its own failures), stops when the worker stops
(:meth:`Upkeep.stop`), and, a daemon, cannot keep a worker's process alive.

Importing this module registers the inspect command (the ``celery`` CLI checks command names,
and imports this package through its ``celery.commands`` entry point) and connects one
``worker_init`` receiver that adds the bootstep to the starting worker's app. The dead-run
receivers are connected by the step while its worker runs, and only act for its app.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import redis
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Celery, Task, bootsteps
from celery.signals import (
    task_failure,
    task_revoked,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
)

from ..core.admin import Holder, SemaphoreAdmin
from ..core.heartbeat import flush_releases
from ..errors import SemaphoreBackendError, SemaphoreError, SemaphoreValidationError
from . import stats
from .remote import worker_report  # importing it registers `celery inspect semaphores`
from .runner import run_function, runner_of
from .settings import app_settings, client_for, forget, journal_for
from .store import broker_visibility_timeout
from .store_watch import StoreWatch
from .waiting_room.queues import (
    broadcast_refusal,
    broadcast_route_of,
    consume_handoff_queues,
    warm_publisher,
)
from .waiting_room.sweeps import PAGE, RoomSweeper

logger = logging.getLogger(__name__)

_HOST = socket.gethostname()

RECHECK = 0.1
"""Seconds between checks of whether a dead run's process has exited."""
PATIENCE = 10.0
"""Seconds to keep checking before leaving a still-living holder's slot to its lease."""


class DeadRunReleaser:
    """Frees the slots of runs whose pool process died, from the worker's main process.

    Args:
        app (Celery): the worker's app; runs of other apps' tasks are left alone.
        timer (Any): the worker's ``kombu`` timer, for rechecks of a holder still alive.
    """

    def __init__(self, app: Celery, timer: Any) -> None:
        self.app = app
        self.timer = timer

    def on_task_failure(
        self,
        sender: Any = None,
        task_id: str | None = None,
        exception: BaseException | None = None,
        args: Any = None,
        kwargs: Any = None,
        **_: Any,
    ) -> None:
        """``task_failure`` receiver. Ordinary failures are sent from the process that ran
        the body, which released its slot already; only these two mean it is gone."""
        if isinstance(exception, (WorkerLostError, TimeLimitExceeded)) and task_id:
            self.release(sender, task_id, tuple(args or ()), dict(kwargs or {}))

    def on_task_revoked(
        self, sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
    ) -> None:
        """``task_revoked`` receiver: a terminated run's process may be gone; a run revoked
        or expired before it ran leaves the waiting room (with its reservation, if any)."""
        if request is None:
            return
        args, kwargs = tuple(request.args or ()), dict(request.kwargs or {})
        if terminated:
            self.release(sender, request.id, args, kwargs)
        else:
            self.cancel(sender, request.id, args, kwargs)

    def cancel(
        self, task: Task, task_id: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        """Take run ``task_id`` out of its key's waiting room, if it is there."""
        found = runner_of(task)
        if found is None or not task_id or getattr(task, "app", None) is not self.app:
            return
        runner, takes_task = found
        try:
            keys = runner.keys_for((task, *args) if takes_task else tuple(args), kwargs)
            room = runner.resolve(task.app)[0].room
            for key in keys:
                if room.cancel(key, task_id):
                    forget(self.app, task_id)
                    logger.info("semaphore %r: revoked task %s left the waiting room", key, task_id)
        except (SemaphoreError, TypeError) as exc:
            logger.warning("could not take task %s out of its waiting room: %s", task_id, exc)

    def release(
        self, task: Task, task_id: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> int:
        """Release the slots run ``task_id`` of ``task`` holds from this host, once the
        process that holds each one is gone.

        A holder whose process is already dead is released now. One whose process still
        runs (a hard time limit is signalled to the child just *after* Celery reports it; a
        revoke may send a signal the child ignores) is checked again every ``RECHECK``
        seconds for up to ``PATIENCE`` seconds, and left to its lease if it lives on: a body
        that keeps running keeps renewing, and must keep its slot.

        Returns:
            int: how many slots were released now (later releases are logged, not counted).
        """
        found = runner_of(task)
        if found is None or not task_id or getattr(task, "app", None) is not self.app:
            return 0
        runner, takes_task = found
        try:
            keys = runner.keys_for((task, *args) if takes_task else tuple(args), kwargs)
            admin = runner.resolve(task.app)[0].admin
            holders = [
                (key, h)
                for key in keys
                for h in admin.holders(key)
                if h.metadata.get("task_id") == task_id and h.metadata.get("host") == _HOST
            ]
        except (SemaphoreError, TypeError) as exc:
            logger.warning("could not find the slot of dead task %s: %s", task_id, exc)
            return 0
        released = 0
        for key, holder in holders:
            if self._release_if_gone(admin, key, holder, task_id):
                released += 1
            else:
                self._recheck(admin, key, holder, task_id, time.monotonic() + PATIENCE)
        return released

    def _release_if_gone(
        self, admin: SemaphoreAdmin, key: str, holder: Holder, task_id: str
    ) -> bool:
        """Release one dead run's slot if the holder's process is gone; True when released
        (or already free)."""
        pid = holder.metadata.get("pid")
        if isinstance(pid, int) and not _pid_gone(pid):
            return False
        try:
            if admin.force_release(key, holder.token):
                stats.bump(self.app, holder.metadata.get("worker"), "dead_released")
                logger.warning(
                    "semaphore %r: released the slot of task %s, whose process died", key, task_id
                )
        except SemaphoreError as exc:
            logger.warning("could not release the slot of dead task %s: %s", task_id, exc)
        return True

    def _recheck(
        self, admin: SemaphoreAdmin, key: str, holder: Holder, task_id: str, deadline: float
    ) -> None:
        """Try :meth:`_release_if_gone` again every ``RECHECK`` seconds, on the worker's
        timer, until it releases or ``deadline`` (monotonic) passes."""

        def again() -> None:
            if (
                not self._release_if_gone(admin, key, holder, task_id)
                and time.monotonic() < deadline
            ):
                self.timer.call_after(RECHECK, again)

        self.timer.call_after(RECHECK, again)


def _pid_gone(pid: int) -> bool:
    """True when process ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except OSError as exc:  # no such process; or another user's, alive (PermissionError)
        return isinstance(exc, ProcessLookupError)
    return False


def survive_broker_restarts() -> bool:
    """In a worker whose broker is Redis, make kombu's Redis channel raise a connection error,
    not an ``AttributeError``, when asked to connect through a transport already closed, so
    that the worker survives a restart of its broker while messages wait in it. Idempotent; a
    channel whose transport is open is not touched.

    Shed runs (and Celery's own countdown and ETA tasks) wait out their countdown in the
    worker that fetched them, unacknowledged. On Celery 5.7.0 with kombu 5.7.0 (the only kombu
    that Celery 5.7 accepts), a broker connection lost at such a moment took the worker's main
    process down. The consumer first collects the lost connection (``Connection.collect()``,
    which drops the kombu transport's ``client``), then closes it (``Connection.close()``);
    closing its default channel again restores the unacknowledged messages
    (``QoS.restore_unacked_once``), and kombu's Redis channel, whose pools it has just
    disconnected, builds a new one from the transport's ``client``: ``Channel._connparams``
    raises ``AttributeError: 'NoneType' object has no attribute 'hostname'``, which is not a
    connection error, so neither kombu nor Celery ignores it, and the worker stops with
    "Unrecoverable error". Celery 5.4 to 5.6 only collect the connection, and never meet it
    (checked with kombu 5.3.4, 5.5.4, 5.6.2 and 5.7.0).

    With the guard that call raises a Redis ``ConnectionError`` instead: the close then goes
    on as for any broker out of reach, and the consumer reconnects. The messages it could not
    restore stay in the broker's ``unacked`` hash, which kombu restores after the
    ``visibility_timeout``, as after any connection lost while the broker is down (a broker
    restarted without persistence has lost them anyway).

    Returns:
        bool: whether the guard is in place (False: kombu's Redis transport has no
        ``Channel._connparams`` to guard).
    """
    from kombu.transport import redis as kombu_redis

    connparams = getattr(kombu_redis.Channel, "_connparams", None)
    if connparams is None:
        return False
    if getattr(connparams, "__semaphore_guard__", False):
        return True

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        transport = getattr(self, "connection", None)
        if transport is None or getattr(transport, "client", None) is None:
            raise redis.ConnectionError("the broker connection was closed; reconnecting")
        return connparams(self, *args, **kwargs)

    guarded.__semaphore_guard__ = True  # type: ignore[attr-defined]
    guarded.__wrapped__ = connparams  # type: ignore[attr-defined]
    kombu_redis.Channel._connparams = guarded  # type: ignore[method-assign]
    return True


STOP_TIMEOUT = 10.0
"""Seconds :meth:`Upkeep.stop` waits for the thread to finish what it is doing."""


class Upkeep:
    """The upkeep thread of one worker (see the module).

    Args:
        watch (StoreWatch): the worker's watch on its store.
        sweeper (RoomSweeper | None): the sweeper of an app with a queueing task; None: the
            thread only watches the store.
        interval (float): seconds between two checks of the store, and between two sweeps of
            one room by the fleet (> 0).
        reachable (bool): whether the store answered the check made at start-up.
        timer (Any): the worker's ``kombu`` timer, or None (see :meth:`start`).
    """

    def __init__(
        self,
        watch: StoreWatch,
        sweeper: RoomSweeper | None,
        interval: float,
        reachable: bool = False,
        timer: Any = None,
    ) -> None:
        self.watch, self.sweeper, self.interval = watch, sweeper, interval
        self._reachable = reachable
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._timer, self._wakes = timer, None

    def start(self) -> None:
        """Start the thread (a second call does nothing). With the worker's timer, also put
        an entry on it that does nothing every interval: the worker's main loop then wakes
        at least that often, as it did when it swept on that timer. An in-process worker
        (``celery.contrib.testing``) notices a request to stop only when its loop wakes,
        which on a quiet AMQP connection and a timer with nothing due soon can take 10 s."""
        if self._thread is not None:
            return
        if self._timer is not None:
            self._wakes = self._timer.call_repeatedly(self.interval, lambda: None)
        self._thread = threading.Thread(target=self._run, name="celery-semaphore-upkeep",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Stop the thread, and wait up to ``timeout`` seconds for it to end (a sweep under
        way finishes its room first). Never raises.

        Returns:
            bool: whether it ended in time (one that did not is a daemon, and ends with the
            process).
        """
        self._stopping.set()
        if self._wakes is not None:
            self._wakes.cancel()
            self._wakes = None
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the semaphore upkeep thread did not stop within %gs", timeout)
            return False
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # never out of the thread: the worker goes on without it
            logger.error("the semaphore upkeep thread stopped", exc_info=True)

    def _loop(self) -> None:
        next_tick = time.monotonic()  # the thread's first step is a tick
        while not self._stopping.is_set():
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + self.interval
                self._reachable = self.watch.check()
                if self._reachable and self.sweeper is not None:
                    self.sweeper.tick()
            wait = next_tick - time.monotonic()
            if self._reachable and self.sweeper is not None and not self._stopping.is_set():
                due = self.sweeper.sweep_due()
                if due is None:
                    self._reachable = False  # until the next check says otherwise
                elif len(due.keys) >= PAGE or 0 <= due.next_ms <= due.now_ms:
                    wait = 0.0  # more rooms are due than a page: go on at once
                else:
                    until = (due.next_ms - due.now_ms) / 1000 if due.next_ms >= 0 else wait
                    quarter = self.interval / 4
                    # Jittered, so that the workers of a fleet do not ask in step.
                    wait = min(wait, max(quarter / 2, min(until, quarter)))
                    wait *= random.uniform(0.9, 1.1)
            self._stopping.wait(max(0.0, wait))


class SemaphoreStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: checks the bounded tasks, frees dead runs' slots, sweeps the waiting
    rooms, feeds ``inspect stats``, and makes the worker consume a hand-off queue beside each
    of its queues when the app has a queueing task (see
    :mod:`~celery_semaphore.integration.waiting_room.queues`).

    Creating the step resolves every bounded task's options against the app's
    ``semaphore_*`` settings, so a bad setting, or a task option that conflicts with one,
    stops the worker at start-up with a :class:`SemaphoreValidationError` naming it instead
    of failing the task's first run; so does a task whose own options are invalid. With a
    Redis broker, a ``shed_max_countdown`` above half the broker's ``visibility_timeout`` is
    refused the same way: a message held back longer than that is delivered again, and the
    task runs twice (a back-off's longer cool-down is shed in pieces of at most that
    countdown: see :func:`~.shedding.shed`). So is a task that parks or sheds (any
    ``on_full`` but ``"raise"``) and is routed to a broadcast queue (see
    :func:`~celery_semaphore.integration.waiting_room.queues.broadcast_queue_of`). A task
    whose start rate can hand a run off for an instant further ahead than half the
    ``visibility_timeout`` (about its limit times the rate's spacing) is named in a WARNING
    line: it starts, as the backlog that would take a hand-off that far may never come.
    """

    requires = ("celery.worker.components:Timer", "celery.worker.components:Pool")

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.releaser: DeadRunReleaser | None = None
        self._upkeep: Upkeep | None = None
        # Sweeping scans the keyspace: only workers of an app with a queueing task do it.
        self.queues = False
        self.bounded = False  # whether the app has a bounded task: then its store is watched
        app = worker.app
        visibility = broker_visibility_timeout(app)  # None: the broker is not Redis
        if visibility is not None:
            # Shed runs wait out their countdown in this worker: a restart of a Redis broker
            # must not take it down meanwhile.
            survive_broker_restarts()
        unreachable: SemaphoreBackendError | None = None
        for task in list(app.tasks.values()):
            # A task whose options are invalid runs task.refusing: every run raises its error.
            refused = getattr(run_function(task)[0], "__semaphore_error__", None)
            if isinstance(refused, SemaphoreValidationError):
                raise refused
            found = runner_of(task)
            if found is None:
                continue
            self.bounded = True
            try:
                policy, limits = found[0].policy_and_limits(app)
            except SemaphoreValidationError as exc:
                raise SemaphoreValidationError(
                    f"task {task.name!r}: {exc} (its options, over its semaphore's "
                    "app.conf.semaphores declaration, over the app's semaphore_* settings)",
                    exc.key,
                    exc.limit,
                ) from None
            # "wait" parks too, once its wait is over.
            self.queues = self.queues or policy.on_full in ("queue", "wait")
            broadcast = broadcast_route_of(app, task) if policy.on_full != "raise" else None
            if broadcast is not None:
                raise broadcast_refusal(task.name, broadcast, policy.on_full)
            if visibility is not None and policy.shed_max_countdown > visibility / 2:
                raise SemaphoreValidationError(
                    f"task {task.name!r}: shed_max_countdown ({policy.shed_max_countdown:g}s) "
                    f"must be at most half the Redis broker's visibility_timeout "
                    f"({visibility:g}s), or held-back messages are delivered twice",
                )
            # A rate's hand-off waits in a worker for its instant: with the whole limit
            # reserved in a row, the last one about limit x units x spacing ahead (a callable
            # limit or units counts 1: at least that far).
            most = limits.adaptive.max if limits.adaptive else limits.default
            ahead, rate = max(
                ((most * (r.units if isinstance(r.units, int) else 1) - r.burst)
                 * r.interval_ms / 1000, r.spec) for r in policy.rates
            ) if policy.rates else (0.0, "")  # fmt: skip
            if visibility is not None and ahead > visibility / 2:
                logger.warning(
                    "task %r: under its rate %s, a hand-off can wait %gs for its instant, more "
                    "than half the Redis broker's visibility_timeout (%gs): the broker delivers "
                    "it again meanwhile (a task with ignore_result runs twice); raise "
                    "visibility_timeout, or lower the limit", task.name, rate, ahead, visibility,
                )  # fmt: skip
            try:
                found[0].resolve(app)
            except SemaphoreBackendError as exc:
                unreachable = exc
        if unreachable is not None:
            # An unreachable store is no reason not to start: runs are shed until it is back.
            logger.warning("semaphore store unreachable at start-up: %s", unreachable)
        # Before the consumer starts, so that it consumes them with the worker's own queues.
        if self.queues and app_settings(app).handoff_queues:
            added = consume_handoff_queues(app)
            if added:
                logger.info("consuming hand-off queues %s", ", ".join(added))
        # Before the pool forks: each pool process then meets the broker as it starts, and
        # writes its last counts as it ends; and finds the journal this process found (or
        # that none can be written, said once here, not once per process).
        self._warm: Any = None
        if self.queues:
            journal_for(app)

            def warm(**_: Any) -> None:
                warm_publisher(app)

            worker_process_init.connect(warm, weak=False)
            self._warm = warm
        worker_process_shutdown.connect(_flush_counts, weak=False)

    def start(self, worker: Any) -> None:
        app = worker.app
        self.releaser = DeadRunReleaser(app, worker.timer)
        task_failure.connect(self.releaser.on_task_failure, weak=False)
        task_revoked.connect(self.releaser.on_task_revoked, weak=False)
        if not self.bounded:
            return

        def first_reach() -> None:
            stats.reset(app, worker.hostname)
            admin = SemaphoreAdmin(client_for(app), app_settings(app).prefix)
            for warning in admin.server_warnings():
                logger.warning("%s", warning)

        # The store is checked once now, in this thread, so that the worker's start-up checks
        # of it (its counters reset, the server's warnings, the persistence line) come before
        # any of its runs; then the upkeep thread starts.
        watch = StoreWatch(app, self.queues, first_reach)
        sweeper = RoomSweeper(app, worker.hostname) if self.queues else None
        reachable = watch.check()
        self._upkeep = Upkeep(watch, sweeper, app_settings(app).sweep_interval, reachable,
                              worker.timer)  # fmt: skip
        self._upkeep.start()

    def stop(self, worker: Any) -> None:
        self.terminate(worker)  # first: its sweeps count too
        stats.flush()  # the counts of runs in this process (threads and solo pools)
        worker_process_shutdown.disconnect(_flush_counts)
        if self._warm is not None:
            worker_process_init.disconnect(self._warm)
            self._warm = None
        if self.releaser is not None:
            task_failure.disconnect(self.releaser.on_task_failure)
            task_revoked.disconnect(self.releaser.on_task_revoked)
            self.releaser = None

    def terminate(self, worker: Any) -> None:
        # A cold shutdown calls this alone: the upkeep thread stops with the worker either way.
        if self._upkeep is not None:
            self._upkeep.stop()
            self._upkeep = None

    def info(self, worker: Any) -> dict[str, Any]:
        return {"semaphore": worker_report(worker.app, worker.hostname)}


def _flush_counts(**_: Any) -> None:
    # A pool process that ends (it runs no atexit hook): its runs' releases first.
    flush_releases()
    stats.flush()


def _add_step(sender: Any = None, **_: Any) -> None:
    # worker_init is sent before the worker builds its blueprint from app.steps, and before
    # it forks: what is set on the app here reaches every pool process.
    sender.app.__dict__["_semaphore_task_events"] = bool(getattr(sender, "task_events", False))
    steps = sender.app.steps["worker"]
    if SemaphoreStep not in steps:
        steps.add(SemaphoreStep)


worker_init.connect(_add_step, weak=False)
