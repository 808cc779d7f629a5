"""The journal: each host's own record of the runs its processes parked, so that a restart of
the semaphore store that loses the waiting rooms loses no run.

A parked run's message is acknowledged when it parks: the room in the store holds its only
copy. A store restarted without persistence (or rolled back to an older snapshot) would
lose it for good, where Celery alone, on a broker that kept the message, would have lost
nothing. So a process about to park a run first writes the run's message to a SQLite file
on its host (one per store, prefix and host, shared by the worker's processes), stamped with
the store's *incarnation* (:mod:`.incarnation`) as read before the park; a run that takes a
slot instead, or claims its slot on this host, is struck out at once. Written before the
park, the entry is there before any hand-off of the run can strike it out; stamped before
it, a restart in between leaves the older incarnation, and the run is looked for again.

Each worker pages through its host's journal on its timer
(:class:`JournalKeeper`): an entry whose run is still parked stays; one whose run left the
room since the store last changed incarnation was served elsewhere and goes; and one whose
run is gone from a store of another incarnation was lost by the store, and is sent again to
its own queue, as a new arrival that keeps its first arrival time (see the guarantees page).
An entry younger than :data:`~.keeper.SETTLE` seconds is not judged: its park may still be
on its way to the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS parked (waiter TEXT PRIMARY KEY, keys TEXT NOT NULL, "
    "payload BLOB NOT NULL, incarnation TEXT NOT NULL, at REAL NOT NULL DEFAULT 0)"
)


def default_directories() -> list[Path]:
    """Where journals may go unless ``semaphore_journal`` names a directory, in the order
    they are tried: ``celery-semaphore`` in the user's state directory (``$XDG_STATE_HOME``,
    else ``~/.local/state``), which outlives a worker's restart, unlike most temporary
    directories after a reboot; then, for a user with no home or an unwritable one (an
    arbitrary uid in a container, a read-only ``HOME``), ``celery-semaphore-<uid>`` in the
    system's temporary directory."""
    found = []
    base = os.environ.get("XDG_STATE_HOME")
    if not base:
        with contextlib.suppress(RuntimeError, KeyError):  # no HOME, no passwd entry
            base = str(Path.home() / ".local" / "state")
    if base:
        found.append(Path(base) / "celery-semaphore")
    return [*found, Path(tempfile.gettempdir()) / f"celery-semaphore-{os.getuid()}"]


JOURNAL_OFF = (
    "semaphore_journal: no journal of parked runs can be written on this host (%s): the "
    "runs its worker parks have no second copy, and a restart of the semaphore store that "
    "loses its waiting rooms loses them; set semaphore_journal to a writable directory "
    "(or to False, to say so)"
)


def open_journal(directory: str, store_url: str, prefix: str) -> Journal | None:
    """This host's journal for one store and prefix, in ``directory`` ("": the first of
    :func:`default_directories` that can be written), opened once to be sure it can be
    written; or None, said in one WARNING line (:data:`JOURNAL_OFF`), when none can."""
    failed = []
    # A file of this host's own (a host that shares its directory with others, over NFS say,
    # still writes its own), for one store and prefix.
    name = hashlib.sha256(f"{store_url}\n{prefix}".encode()).hexdigest()[:16]
    for place in [Path(directory)] if directory else default_directories():
        journal = Journal(place / f"{socket.gethostname()}-{name}.sqlite3")
        try:
            with journal._db():
                return journal
        except (sqlite3.Error, OSError) as exc:
            failed.append(f"{place}: {exc}")
    logger.warning(JOURNAL_OFF, "; ".join(failed))
    return None


def warn_now_and_then(what: str, *args: object) -> None:
    """Log ``what % args`` at WARNING unless the same ``what`` was logged less than a minute
    ago: a journal that fails keeps failing, and its every park or sweep must not say so."""
    now = time.monotonic()
    if now - _SAID.get(what, -math.inf) >= 60.0:
        _SAID[what] = now
        logger.warning(what, *args)


_SAID: dict[str, float] = {}


@dataclass(frozen=True)
class Entry:
    """One journaled run: its row, id (the waiter), the keys it asks for (a run of several
    keys waits in one room after another), its payload (the message a hand-off publishes),
    the store's incarnation when it was about to park, and when it was journaled (epoch
    seconds)."""

    row: int
    waiter: str
    keys: tuple[str, ...]
    payload: bytes
    incarnation: str
    at: float = 0.0

    @property
    def key(self) -> str:
        """The keys, joined with ``+`` (for messages)."""
        return "+".join(self.keys)


class Journal:
    """A host's journal file (see the module). Every method that writes never raises: a
    journal that cannot be written is logged (at most once a minute), and the run is no
    worse off than without one.

    Args:
        path (Path): the SQLite file; its directory is made if missing.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._open: tuple[int, sqlite3.Connection, threading.Lock] | None = None

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """The process's connection, for one caller at a time (a forked process makes its
        own). One per process, not per thread: in a gevent or eventlet pool every task runs
        in a greenlet of its own, and a thread-local connection would be opened and set up
        anew for each park, at a cost of ten writes, in the one thread that also publishes
        the hand-offs."""
        found = self._open
        if found is None or found[0] != os.getpid():
            # Two threads that race here each use their own connection once: harmless.
            found = self._open = (os.getpid(), self._connect(), threading.Lock())
        with found[2]:
            yield found[1]

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None,
                             check_same_thread=False)  # fmt: skip
        # Several processes write at once: WAL lets readers and one writer work together.
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(_SCHEMA)
        if "at" not in {row[1] for row in db.execute("PRAGMA table_info(parked)")}:
            db.execute("ALTER TABLE parked ADD COLUMN at REAL NOT NULL DEFAULT 0")  # 0.1.0's
        return db

    def record(
        self, waiter: str, keys: Sequence[str], payload: bytes, incarnation: str,
        at: float | None = None,
    ) -> None:  # fmt: skip
        """Journal a run of ``keys`` about to park, at ``at`` (epoch seconds; None: now). A
        run parked again keeps one entry, stamped anew."""
        self._write(
            "INSERT OR REPLACE INTO parked (waiter, keys, payload, incarnation, at) "
            "VALUES (?, ?, ?, ?, ?)",
            (waiter, json.dumps(list(keys)), payload, incarnation,
             time.time() if at is None else at),
        )  # fmt: skip

    def forget(self, waiter: str) -> None:
        """Strike out a run that left the room (claimed its slot, gave up, was revoked)."""
        self._write("DELETE FROM parked WHERE waiter = ?", (waiter,))

    def take(self, entry: Entry) -> bool:
        """Strike ``entry`` out for the caller alone: True for the one caller of the host's
        processes that struck it (which then sends its run again), False for every other
        (another worker of the host took it first, or the run left the room meanwhile).

        Raises:
            sqlite3.Error, OSError: the file cannot be written.
        """
        with self._db() as db:
            cursor = db.execute(
                "DELETE FROM parked WHERE rowid = ? AND waiter = ?", (entry.row, entry.waiter)
            )
            return cursor.rowcount == 1

    def restamp(self, waiter: str, incarnation: str) -> None:
        """Mark a run as found parked in the store's ``incarnation``."""
        self._write("UPDATE parked SET incarnation = ? WHERE waiter = ?", (incarnation, waiter))

    def _write(self, sql: str, args: tuple[object, ...]) -> None:
        try:
            with self._db() as db:
                db.execute(sql, args)
        except (sqlite3.Error, OSError) as exc:
            warn_now_and_then("could not write the waiting room's journal %s: %s", self.path, exc)

    def page(self, after: int, limit: int) -> list[Entry]:
        """Up to ``limit`` entries after row ``after``, in row order.

        Raises:
            sqlite3.Error, OSError: the file cannot be read.
        """
        with self._db() as db:
            rows = db.execute(
                "SELECT rowid, waiter, keys, payload, incarnation, at FROM parked "
                "WHERE rowid > ? ORDER BY rowid LIMIT ?", (after, limit),
            ).fetchall()  # fmt: skip
        return [Entry(int(r), str(w), tuple(json.loads(k)), bytes(p), str(i), float(a))
                for r, w, k, p, i, a in rows]  # fmt: skip

    def keys_of(self, waiters: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """The keys each of ``waiters`` that this host journaled asks for (those it did not
        journal are left out).

        Raises:
            sqlite3.Error, OSError: the file cannot be read.
        """
        found: dict[str, tuple[str, ...]] = {}
        with self._db() as db:
            for waiter in waiters:  # a look-up by primary key each: revokes come a few at once
                row = db.execute("SELECT keys FROM parked WHERE waiter = ?", (waiter,)).fetchone()
                if row is not None:
                    found[waiter] = tuple(json.loads(row[0]))
        return found

    def entries(self, page: int = 500) -> Iterator[Entry]:
        """Every entry, a page at a time (for tests and the views)."""
        after = 0
        while batch := self.page(after, page):
            yield from batch
            after = batch[-1].row
