"""A worker's watch on its semaphore store: whether it can be reached, and what its
persistence means for parked runs.

The worker's main process checks the store (a PING) once at start-up, then in its upkeep
thread (:class:`~.worker.Upkeep`) every ``semaphore_sweep_interval`` seconds, before it sweeps the
waiting rooms.
While the store cannot be reached it says so in one warning line, naming the store (its
password masked) and what happens to runs meanwhile, and says it again after 2, 4, 8, ...
seconds, at most once every :data:`MAX_REPEAT` seconds, instead of a traceback on every
sweep; the sweeps wait, and a line says when the store is back. The first time the store
answers, the worker does its start-up checks of it, and says in one line what its
persistence means for parked runs (:func:`persistence_note`).

State: none in Redis; the watch lives in the worker's main process and ends with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from ..core.live import text_of
from ..core.scripts import REDIS_ERRORS
from ..errors import SemaphoreBackendError
from .settings import app_settings, client_for, journal_for

logger = logging.getLogger(__name__)

FIRST_REPEAT = 2.0
"""Seconds between the first two lines saying the store cannot be reached."""
MAX_REPEAT = 60.0
"""The most seconds between two such lines: each wait doubles, up to this."""


class StoreWatch:
    """Checks ``app``'s semaphore store when called, and says when it cannot be reached.

    Args:
        app (Celery): the worker's app.
        parks (bool): whether the app has a task that parks runs in the waiting room (the
            persistence line is about parked runs, and is said only then).
        on_first_reach (Callable[[], None] | None): called once, the first time the store
            answers (the worker's start-up checks of it); never raises into the watch.
        clock (Callable[[], float]): monotonic seconds.
    """

    def __init__(
        self,
        app: Celery,
        parks: bool,
        on_first_reach: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app, self.parks = app, parks
        self.on_first_reach = on_first_reach
        self.clock = clock
        self.down_since: float | None = None
        self._reached = False
        self._next_line = 0.0
        self._repeat = FIRST_REPEAT

    def check(self) -> bool:
        """PING the store. Never raises.

        Returns:
            bool: whether it answered.
        """
        try:
            client_for(self.app).ping()
        except Exception as exc:
            self.failed(exc)
            return False
        self.reached()
        return True

    def failed(self, error: BaseException) -> None:
        """The store could not be reached: say so now if a line is due (see the module
        docstring for when)."""
        now = self.clock()
        if self.down_since is None:
            self.down_since, self._next_line, self._repeat = now, now, FIRST_REPEAT
        if now < self._next_line:
            return
        logger.warning(
            "semaphore store %s unreachable%s: %s: %s. Until it is back, bounded runs are "
            "shed with a countdown (those with on_full='raise' fail) and the waiting rooms "
            "are not swept; next report in %gs",
            self._store(),
            f" for {now - self.down_since:.0f}s" if now > self.down_since else "",
            type(error).__name__,
            error,
            self._repeat,
        )
        self._next_line = now + self._repeat
        self._repeat = min(self._repeat * 2, MAX_REPEAT)

    def reached(self) -> None:
        """The store answered: say so if it could not be reached before, and do the first
        reach's checks."""
        if self.down_since is not None:
            logger.warning(
                "semaphore store %s reachable again, after %.0fs",
                self._store(),
                self.clock() - self.down_since,
            )
            self.down_since = None
        if self._reached:
            return
        self._reached = True
        if self.parks:
            journal = journal_for(self.app)
            note = persistence_note(client_for(self.app), self._store())
            off = app_settings(self.app).journal is None
            logger.info(
                "%s; %s", note, journal_note(None if journal is None else journal.path, off)
            )
        if self.on_first_reach is not None:
            try:
                self.on_first_reach()
            except (SemaphoreBackendError, *REDIS_ERRORS) as exc:
                # The store went again meanwhile: an outage, which the next check reports in
                # its one line, not a fault with a traceback.
                logger.warning("could not check the semaphore store: %s", exc)
            except Exception:  # telemetry and advice: never stop a worker over them
                logger.warning("could not check the semaphore store", exc_info=True)

    def _store(self) -> str:
        store = app_settings(self.app).store
        return f"{store.url} ({store.setting})"


def persistence_note(client: Any, store: str) -> str:
    """One line on what the store's persistence means for parked runs, read with ``CONFIG
    GET`` (``save``, ``appendonly``, ``appendfsync``), else with ``INFO persistence``. A
    parked run's message lives only in the store (see :mod:`.waiting_room.parking`), so
    this is what a restart or a crash of the store costs the waiting room. Never raises.

    Args:
        client (redis.Redis): a client of the store.
        store (str): how to name the store in the line (its URL, password masked).

    Returns:
        str: the line.
    """
    head = f"semaphore store {store}:"
    try:
        config = {}
        for name in ("save", "appendonly", "appendfsync"):
            reply = dict(client.config_get(name))
            config.update({text_of(k): text_of(v) for k, v in reply.items()})
        save, appendonly = config["save"].strip(), config["appendonly"]
        fsync = config.get("appendfsync", "everysec")
    except Exception:
        return _note_from_info(client, head)
    if appendonly == "yes":
        return f"{head} {_aof(fsync)}"
    if save:
        return (
            f"{head} RDB snapshots only (save {save!r}, appendonly no): a crash of the "
            "store loses what its rooms took since its last snapshot (a clean shutdown "
            "writes one)"
        )
    return (
        f"{head} no persistence (save '', appendonly no): a restart of the store loses "
        "every waiting room"
    )


def journal_note(path: object, off: bool = False) -> str:
    """What the host's journal adds to the store's persistence: the runs this host parked
    are sent again if the store loses them (see :mod:`.waiting_room.journal`), or, with
    ``semaphore_journal = False`` (``off``) or no journal that can be written (``path``
    None), not."""
    if off:
        return "semaphore_journal is off: what the store loses of the waiting rooms is lost"
    if path is None:
        return (
            "no journal of parked runs can be written on this host (see the warning above): "
            "what the store loses of the waiting rooms is lost"
        )
    return (
        f"this host's journal ({path}) sends the runs its worker parked again if the store "
        "loses them, while a worker of this host runs or restarts with it"
    )


def _aof(fsync: str) -> str:
    cost = {
        "always": "a crash of the store loses no parked run it acknowledged",
        "everysec": "a crash of the store loses at most about the last second of parked runs",
        "no": "a crash of the store loses the parked runs the operating system had not yet "
        "written (up to about 30 s of them)",
    }.get(fsync, "a crash of the store loses what its fsync policy had not yet written")
    return f"append-only file (appendfsync {fsync}): {cost}"


def _note_from_info(client: Any, head: str) -> str:
    """The line for a server that refuses ``CONFIG GET`` (some managed services)."""
    try:
        enabled = int(client.info("persistence").get("aof_enabled", 0))
    except Exception:
        enabled = 0
    if enabled:
        return f"{head} {_aof('unknown')} (CONFIG GET refused, read from INFO)"
    return (
        f"{head} persistence unknown (the server refuses CONFIG GET): a restart of the store "
        "may lose every parked run"
    )
