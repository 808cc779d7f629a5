"""The room index: which keys' waiting rooms may hold waiters, and when each is next due for
a sweep, so that a fleet's sweeps share the rooms out instead of each scanning the keyspace
(a full scan, once a minute for the whole fleet, is the backstop)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from typing import cast

import redis

from .admin import scan_keys
from .calls import due_rooms_call, reschedule_call
from .names import Namespace
from .replies import DueRooms
from .scripts import REDIS_ERRORS, Scripts, backend_errors

logger = logging.getLogger(__name__)

INDEX_EVERY = 2.0
"""Seconds between two writes of one key to the index by one process."""
_ADD_BATCH = 1000  # keys per ZADD of the backstop


def give_up_ms(deadline: int, arrival_ms: int | None, now_ms: int) -> int:
    """When a waiter parked at ``now_ms`` gives up, epoch ms by the store's clock, reckoned
    as park.lua reckons it from its ``deadline`` and ``arrival`` arguments (0: none; a
    negative deadline is a budget from the arrival, a negative arrival a wait before now);
    -1 for a waiter with no deadline."""
    if deadline >= 0:
        return deadline or -1
    arrival = now_ms if arrival_ms is None else arrival_ms
    return (now_ms + arrival if arrival < 0 else arrival) - deadline


class RoomIndex:
    """The sorted set ``<prefix>:rooms``: key -> when its room is next due for a sweep, epoch
    ms by the store's clock (0: at once). A park adds its room due at once unless it is
    there already; :meth:`due` hands out the rooms whose time has come and pushes each one
    interval ahead, so the fleet shares them out, and :meth:`reschedule` then scores each
    with when its sweep says something in it next falls due (a still room: a quarter of its
    TTL on, to keep it alive).

    Args:
        client (redis.Redis): where it lives.
        names (Namespace): the prefix's key names.
        scripts (Scripts): the scripts registered on ``client``.
    """

    def __init__(self, client: redis.Redis, names: Namespace, scripts: Scripts) -> None:
        self.client = client
        self.names = names
        self.key = names.room_index
        self._scripts = scripts
        self._indexed: dict[str, float] = {}  # key -> time.monotonic() of its last add

    def add(self, key: str, ttl_ms: int, new_room: bool = False, due_ms: int = -1) -> None:
        """Add ``key`` to the room index (its room just took a waiter), due for a sweep at
        once if it was not there; a key already there keeps its time, so that a park neither
        puts off a room's sweep nor makes the fleet sweep a busy room at every park, unless
        the waiter is due sooner (``due_ms``).

        At most once per :data:`INDEX_EVERY` seconds per key and process, so a burst of parks
        costs one write; ``new_room`` (the waiter parked at the head of its room, which may
        have just been made) writes regardless, since a sweep may have taken the room's last
        incarnation out of the index a moment ago, and so does a waiter with a deadline
        (``due_ms``): a room where nothing fell due was scored up to a quarter of its TTL
        ahead by its last sweep, which knew nothing of this deadline. Never raises: a key
        left out is found by the next full scan (see :meth:`backstop`), a deadline missed
        by the room's next sweep (the first lease end it saw, while anyone waits).

        Args:
            key (str): the semaphore key whose room took a waiter.
            ttl_ms (int): the index lives at least this long (ms): the room's TTL.
            new_room (bool): write even if this process wrote ``key`` recently.
            due_ms (int): when the waiter gives up, epoch ms by the store's clock (the room
                is then swept no later); -1: it waits for as long as it takes.
        """
        now = time.monotonic()
        if not new_room and due_ms < 0 and now - self._indexed.get(key, -INDEX_EVERY) < INDEX_EVERY:
            return
        if len(self._indexed) > 10_000:  # many keys: forget the old ones, re-index later
            self._indexed.clear()
        self._indexed[key] = now
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.zadd(self.key, {key: 0}, nx=True)
                if due_ms >= 0:
                    pipe.zadd(self.key, {key: due_ms}, lt=True)
                pipe.pexpire(self.key, ttl_ms)
                pipe.execute()
        except REDIS_ERRORS as exc:
            logger.warning("could not index the waiting room of %r: %s", key, exc)

    def due(self, interval: float, count: int, ttl: float) -> DueRooms:
        """Take up to ``count`` rooms whose sweep is due, for this caller to sweep now, and
        make each due again ``interval`` seconds later (by the store's clock): every caller
        gets other rooms, and a room whose caller dies before it sweeps it is due again one
        interval later, for another. One round trip.

        Args:
            interval (float): seconds until the rooms taken are due again (> 0).
            count (int): the most rooms to take (>= 1).
            ttl (float): seconds the index lives at least, once a room is taken (its rooms'
                TTL: the sweeps keep it alive as they keep the rooms).

        Returns:
            DueRooms: the keys taken, the store's time, and when the next room is due.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        interval_ms, ttl_ms = max(1, round(interval * 1000)), max(1, round(ttl * 1000))
        with backend_errors(self.key):
            due = self._scripts.run(due_rooms_call(self.key, interval_ms, max(1, count), ttl_ms))
        return dataclasses.replace(due, taken_ms=due.now_ms + interval_ms)

    def scores(self, keys: Sequence[str]) -> list[int | None]:
        """Each key's score in the index, epoch ms (None: not there); one round trip.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(self.key):
            found = self.client.zmscore(self.key, list(keys))
        return [None if score is None else int(score) for score in found]

    def reschedule(self, rooms: Sequence[tuple[str, int, int]]) -> None:
        """Score each room of ``rooms`` (key, its score when it was taken to sweep, when its
        sweep says it next needs one; epoch ms by the store's clock) with the latter, if it
        is still in the index (one round trip; none for no rooms). A room whose score moved
        since it was taken (a mark of a reservation made after its sweep, a park with a
        deadline: see room.lua's ``room_bring_on``) is only ever brought sooner, so no such
        write is undone (reschedule.lua).

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        if not rooms:
            return
        with backend_errors(self.key):
            self._scripts.run(reschedule_call(self.key, rooms))

    def rooms(self, full_scan: bool = False) -> list[str]:
        """Every key in the room index, and with ``full_scan`` every room a SCAN of the
        keyspace finds (up to 10,000); for the views, which read every room.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(self.key):
            raw = self.client.zrange(self.key, 0, -1)
        found = {m.decode("utf-8") if isinstance(m, bytes) else str(m) for m in raw}
        if full_scan:
            found.update(scan_keys(self.client, self.names.prefix, rooms=True))
        return sorted(found)

    def drop(self, key: str) -> None:
        """Take ``key`` out of the index (a sweep found its room gone). If a park made the
        room again meanwhile, whose own add may have come before this removal, the key goes
        back in, due at once. Two round trips, in order (on a cluster, the index and the
        room live on different nodes).

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(self.key):
            self.client.zrem(self.key, key)
            if self.client.exists(self.names.keys_of(key).parked):
                self.client.zadd(self.key, {key: 0}, nx=True)

    def backstop(self, every: float, owner: str, ttl: float) -> int | None:
        """The backstop for a parking process that died before it indexed its room: once per
        ``every`` seconds for the whole fleet, the caller that takes the fleet's lease (the
        key ``<prefix>:rooms:scan``, which lapses after ``every``) SCANs the keyspace for
        rooms and adds those missing from the index, due at once; every other caller does
        nothing. So the fleet scans the keyspace once a period, however many workers it has.

        Args:
            every (float): seconds between two scans by the fleet (> 0).
            owner (str): who holds the lease (a worker's name), for an operator to read.
            ttl (float): seconds the index lives at least, when it takes a room.

        Returns:
            int | None: how many rooms were missing; None when another caller holds the
            lease.

        Raises:
            SemaphoreBackendError: Redis failed.
        """
        with backend_errors(self.key):
            lease_ms = max(1, round(every * 1000))
            if not self.client.set(self.names.room_scan, owner, nx=True, px=lease_ms):
                return None
            keys = scan_keys(self.client, self.names.prefix, sys.maxsize, rooms=True)
            added = 0
            for start in range(0, len(keys), _ADD_BATCH):
                batch = dict.fromkeys(keys[start : start + _ADD_BATCH], 0)
                added += cast(int, self.client.zadd(self.key, batch, nx=True))
            ttl_ms = max(1, round(ttl * 1000))
            if added and self.client.pttl(self.key) < ttl_ms / 2:
                self.client.pexpire(self.key, ttl_ms)
        return added
