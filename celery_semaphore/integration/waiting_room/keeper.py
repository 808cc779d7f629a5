"""The journal's keeper: once a sweep interval, in each worker's upkeep thread, look up a page
of the host's journaled runs in the store, strike out the ones served elsewhere, and send
again the ones the store lost; and copy the operators' decisions, putting back those a
restart of the store lost (:func:`put_back`).

The cost of a tick is one page (:data:`PAGE` entries, one pipelined round trip, two
``HEXISTS`` each), three reads of the incarnation marker, one ``HGETALL`` of the
decisions hash (sized by the keys that ever had a decision), and a page of the room index
(one ``ZRANGE``, then a ``ZCARD`` per room in one pipelined round trip: see
:meth:`JournalKeeper._count_rooms`), whatever the backlog: a host's journal, and the index,
are gone through a page per tick, from the start again once they reach the end.

State in the store, and its recovery story: ``<prefix>:resent:<incarnation>`` counts the runs
the journals sent again after a restart, and ``<prefix>:loss:<incarnation>`` marks that a
worker said what it lost; both live a day (:data:`LOSS_KEPT`), and a restart that takes them
makes them anew under the next incarnation. ``<prefix>:journals:<incarnation>`` lists the
hosts whose workers ticked under that incarnation in the last day (:data:`LOSS_KEPT`), each
with whether it keeps a journal: the hosts listed before a restart that keep none, or that
have not ticked under the next incarnation, are the ones the line of a loss names (the
keepers' copy in memory spans the restart).
"""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
import time

import redis
from celery import Celery

from ...core.admin import SemaphoreAdmin
from ...core.live import setter, text_of
from ...core.rates import Rate
from ...core.room_reads import parked_or_claimed, room_sizes
from ...core.scripts import REDIS_ERRORS
from ...errors import SemaphoreBackendError, SemaphoreRunLostError
from ..runner import runner_of
from ..settings import app_settings, client_for, journal_for
from ..shedding import HANDOFF_HEADERS
from .incarnation import checked_incarnation, incarnation_of, marker_key
from .journal import Entry, Journal, warn_now_and_then
from .parking import has_ended, message_of

logger = logging.getLogger(__name__)

PAGE = 500
"""Journaled runs looked up per tick."""

REPORT_AFTER = 30.0
"""Seconds after a restart of the store is seen before the fleet's one line of what it lost
is said: the hosts' journals have sent the lost runs again by then (each settled entry
within a tick, a page at a time)."""
NO_JOURNAL = " (no journal)"
"""How ``<prefix>:journals`` lists a host whose workers keep no journal."""
LOSS_KEPT = 24 * 3600
"""Seconds the store keeps its count of the runs sent again, and its loss marker."""

SETTLE = 10.0
"""Seconds a journal entry is left alone when its run is not in the room: a run is journaled
just before it parks, and its park may still be on its way to the store (a slow store, or
one that restarts meanwhile)."""


def put_back(admin: SemaphoreAdmin, field: str, entry: str) -> None:
    """Make the operator's decision of the decisions hash's ``field`` (``entry`` is its
    ``[value, by, at_ms]``, see :func:`~celery_semaphore.core.admin.decision_of`) the key's
    again, in the name of whoever made it, with its entry as it was, and say so in one ERROR
    line if this call changed something (so the workers of a fleet that all put it back say
    it once).

    Raises:
        SemaphoreBackendError: the store failed.
    """
    decision, key = field.split(" ", 1)
    value, by, at = json.loads(entry)
    name = decision[len("rate:") :]  # a rate's name ("" for a pause or a limit)
    shown = value if not name or value is None else f"{value[0]} burst {value[1]}"
    if decision == "pause":
        changed = admin.resume(key, by) if value is None else not admin.pause(key, by)
    elif decision == "limit":
        changed = admin.set_limit(key, value, by) != value
    else:
        rate = None if value is None else Rate(value[0], value[1], name)
        changed = admin.set_rate(key, rate, name=name, by=by) != shown
    # Its entry as it was: a worker whose copy is newer still finds the store's older.
    admin.client.hset(f"{admin.prefix}:decisions", field, entry)
    if changed:
        logger.error(
            "semaphore %r: a restart of the store lost its %s%s, %s by %s at %s; %s by %s", key,
            {"pause": "pause", "limit": "live limit"}.get(decision, f"live {name} rate"),
            "" if value is None or decision == "pause" else f" {shown}",
            "cleared" if value is None else "set", by,
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at / 1000)),
            "cleared again" if value is None else "put back", setter(),
        )  # fmt: skip


def say_feedback_lost(app: Celery) -> None:
    """Say, once per adaptive key of ``app``'s tasks, that a restart of the store lost what
    the provider's answers decided: the adaptive limit starts again from its ``initial``,
    and a cool-down under way is over (adapt.lua's state is not an operator's decision, to
    be put back: it is learnt again from the provider)."""
    for task in app.tasks.values():
        runner = (runner_of(task) or (None,))[0]
        adaptive = runner.limits.adaptive if runner and runner.limits else None
        if runner and adaptive:
            logger.error("semaphore %r: a restart of the store lost its adaptive limit and any "
                         "cool-down; the limit starts again from %d", runner.template.source,
                         adaptive.initial)  # fmt: skip


class JournalKeeper:
    """Keeps ``app``'s journal on this host (a worker's upkeep thread calls :meth:`keep`).

    Args:
        app (Celery): the worker's app.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._after = 0  # the last row looked up; the next tick goes on from there
        # The store's incarnation and decisions hash at the last tick: a copy in memory, not
        # in the journal file, which may have missed a clear while its worker was down.
        self._seen: tuple[str, dict[str, str]] | None = None
        # Runs in line per room: the last pass through the room index, and this one so far.
        self._held: dict[str, int] = {}
        self._pass: dict[str, int] = {}
        self._rooms_at = 0
        # The hosts that ticked (up to a page), as the store last listed them.
        self._hosts: list[str] = []
        # After a restart: its incarnation, the rooms' counts and the hosts before it, when.
        self._loss: tuple[str, dict[str, int], list[str], float] | None = None

    def keep(self) -> None:
        """Put back the operators' decisions a restart of the store lost (see
        :meth:`_keep_decisions`), and look up the next page of journaled runs. Never raises:
        a store or journal that fails is logged, and the tick's work is done again at the
        next."""
        journal = journal_for(self.app)
        try:
            self._keep(journal)
        except (*REDIS_ERRORS, SemaphoreBackendError) as exc:  # the store's watch reports it
            logger.warning("could not look up the waiting room's journal: %s", exc)
        except (sqlite3.Error, OSError) as exc:  # the file's own trouble: said, not traced
            warn_now_and_then("could not read the waiting room's journal %s: %s",
                              journal and journal.path, exc)  # fmt: skip
        except Exception:
            logger.warning("could not look up the waiting room's journal", exc_info=True)

    def _keep(self, journal: Journal | None) -> None:
        client = client_for(self.app)
        prefix = app_settings(self.app).prefix
        current = checked_incarnation(client, prefix)
        # The decisions hash, copied every tick (one HGETALL, sized by the keys with
        # decisions); after a restart, what the copy holds newer than the store is put back.
        admin = SemaphoreAdmin(client, prefix)
        raw = client.hgetall(f"{prefix}:decisions")
        # Read after it: a store that restarted in between answered from its new hash.
        marker = client.get(marker_key(prefix))
        if incarnation_of(marker) != current:
            return  # it restarted since ``current`` was read: the next tick sees it
        store = {text_of(field): text_of(value) for field, value in raw.items()}
        if self._seen is not None and self._seen[0] != current:
            for field, value in self._seen[1].items():
                if json.loads(value)[2] > json.loads(store.get(field, "[0, 0, 0]"))[2]:
                    put_back(admin, field, value)
            say_feedback_lost(self.app)
            self._loss = (current, {**self._held, **self._pass}, self._hosts, time.time())
        self._seen = (current, store)
        self._count_rooms(client, prefix, current, journal is not None)
        if journal is None:
            return
        entries = journal.page(self._after, PAGE)
        if not entries:
            self._after = 0
            return
        # A run of several keys waits in one room after another: it is parked if any has it.
        # One the store claimed is served too: a run stamped just before a restart may have
        # parked in the new store, and been handed off and claimed there. The marker is read
        # again after the lookups: a store that restarted in between answered them from its
        # new, empty rooms, which must not read as runs served elsewhere.
        parked, marker = parked_or_claimed(
            client, prefix, [(e.waiter, e.keys) for e in entries], marker_key(prefix)
        )
        if incarnation_of(marker) != current:
            return
        settled = time.time() - SETTLE
        for entry, here in zip(entries, parked, strict=True):
            if here:
                if entry.incarnation != current:
                    journal.restamp(entry.waiter, current)
            elif entry.at > settled:
                continue
            elif entry.incarnation == current:
                journal.forget(entry.waiter)  # it left the room: claimed elsewhere, or ended
            elif self._resend(journal, entry):  # counted for the fleet's line (_count_rooms)
                client.hincrby(f"{prefix}:resent:{current}", entry.key, 1)
                client.expire(f"{prefix}:resent:{current}", LOSS_KEPT)
        self._after = entries[-1].row

    def _count_rooms(self, client: redis.Redis, prefix: str, current: str, kept: bool) -> None:
        """Count the runs in line in a page of the room index's rooms (a ``ZCARD`` each), and
        list this host in ``<prefix>:journals:<current>`` (``kept``: with a journal); and,
        :data:`REPORT_AFTER` seconds after a restart of the store, say what it lost, in one
        ERROR line per key for the whole fleet (the worker that makes the store's loss marker
        for its incarnation says it): the runs each room held at this worker's last look
        before the restart and after it, how many the hosts' journals sent again, and how
        many are left over, parked by hosts whose journals are not here, naming the hosts
        listed before the restart that keep no journal or have not ticked since."""
        now_ms, hosts = time.time() * 1000, f"{prefix}:journals:{current}"
        with client.pipeline(transaction=False) as pipe:
            pipe.zadd(hosts, {socket.gethostname() + ("" if kept else NO_JOURNAL): now_ms})
            pipe.zremrangebyscore(hosts, 0, now_ms - LOSS_KEPT * 1000)
            pipe.expire(hosts, LOSS_KEPT)
            pipe.zrange(hosts, 0, PAGE - 1)
            self._hosts = list(map(text_of, pipe.execute()[-1]))
        sizes = room_sizes(client, prefix, self._rooms_at, PAGE)
        self._pass.update(sizes)
        if sizes:
            self._rooms_at += PAGE
        else:  # a whole pass through the index: the rooms gone since drop out
            self._held, self._pass, self._rooms_at = self._pass, {}, 0
        if self._loss is None or time.time() - self._loss[3] < REPORT_AFTER:
            return
        seen, held, listed, _ = self._loss
        self._loss = None
        if seen != current or not client.set(
            f"{prefix}:loss:{current}", socket.gethostname(), nx=True, ex=LOSS_KEPT
        ):
            return  # another restart since, or another worker of the fleet says it
        raw = client.hgetall(f"{prefix}:resent:{current}").items()
        resent = {text_of(key): int(count) for key, count in raw}
        now = room_sizes(client, prefix, 0, 0, sorted(held))
        gone = [
            host if host.endswith(NO_JOURNAL) else f"{host} (not seen since)"
            for host in listed
            if host.endswith(NO_JOURNAL) or host not in self._hosts
        ]
        named = f": {', '.join(gone[:10])}{', ...' * (len(gone) > 10)}" if gone else ""
        for key in sorted(set(held) | set(resent)):
            before, after, sent = held.get(key, 0), now.get(key, 0), resent.get(key, 0)
            if sent or before > after:
                logger.error(
                    "semaphore %r: a restart of the store lost runs of its waiting room: it held "
                    "%d at the last look before the restart and %d after; the hosts' journals "
                    "sent %d again; the other %d were parked by hosts whose journals are not "
                    "here (no journal, or no worker of theirs running%s), and are lost", key,
                    before, after, sent, max(0, before - after - sent), named,
                )  # fmt: skip

    def _resend(self, journal: Journal, entry: Entry) -> bool:
        """Send a run the store lost again; True when sent. The host's workers share its
        journal, so only the one that strikes the entry out sends it. One that cannot be read
        is failed with :class:`SemaphoreRunLostError`; one that cannot be published now goes
        back into the journal for the next pass."""
        if not journal.take(entry):
            return False
        if has_ended(self.app, entry.waiter):
            return False  # served on another host before the restart, whose claim it lost
        try:  # to its own queue, as a new arrival: without the marks of the hand-off it was
            # parked for (a run that finds nothing to claim ends), and with the headers that
            # keep its first arrival and its budget
            signature = self.app.signature(message_of(entry.payload))
            headers = signature.options.setdefault("headers", {})
            for mark in HANDOFF_HEADERS:
                headers.pop(mark, None)
            signature.apply_async()
        except (ValueError, KeyError, TypeError) as exc:
            error = SemaphoreRunLostError(
                f"semaphore {entry.key!r}: the store lost parked run {entry.waiter}, and its "
                f"journaled message cannot be sent again ({exc})", entry.key,
            )  # fmt: skip
            logger.error("%s", error.message)
            try:
                self.app.backend.mark_as_failure(entry.waiter, error)
            except Exception:
                logger.warning("could not store the loss of %s", entry.waiter, exc_info=True)
        except Exception:
            logger.warning("could not send lost run %s again yet", entry.waiter, exc_info=True)
            journal.record(entry.waiter, entry.keys, entry.payload, entry.incarnation)
            return False
        logger.info("semaphore %r: sent lost run %s again", entry.key, entry.waiter)
        return True
