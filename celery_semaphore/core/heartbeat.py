"""The renewal thread that keeps a held slot alive while its body runs.

Loss is detected two ways (the leased-semaphore spec's "two-pronged" rule): a renewal that
answers "gone", or a whole lease passing without a renewal that succeeded. The second prong
must work even when a renewal round trip hangs (a paused server, a half-open TCP connection,
a client with no socket timeout), so each round trip runs in a short-lived daemon thread and
the heartbeat waits for it only until the slot's deadline. An abandoned round trip is
harmless: extend never re-creates a member that is gone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .slot import Slot

RenewErrorCallback = Callable[[BaseException], object]


class _RoundTrip:
    """One renewal running in its own daemon thread; ``done`` is set when it answers."""

    def __init__(self, slot: Slot, done: threading.Event) -> None:
        self.ok: bool | None = None
        self.error: BaseException | None = None
        self._slot = slot
        self._done = done
        thread = threading.Thread(target=self._run, name="semaphore-renew", daemon=True)
        thread.start()

    def _run(self) -> None:
        try:
            self.ok = self._slot.renew()
        except BaseException as exc:  # handed to on_renew_error; never kills the heartbeat
            self.error = exc
        finally:
            self._done.set()


class Heartbeat:
    """Renews ``slot`` every ``interval`` seconds from a daemon thread until stopped.

    Args:
        slot (Slot): the slot to keep alive; its ``lost`` event is set when loss is detected.
        interval (float): seconds between renewals, for the slot's current lease. If the
            lease is changed (``slot.extend(lease=...)``), the interval keeps its proportion
            to it, so a shorter lease is renewed sooner.
        on_renew_error (Callable[[BaseException], object] | None): called, in the heartbeat
            thread, with each renewal round trip that failed without saying the slot is
            gone. Such a failure is not a loss; the next tick tries again. An exception raised
            by the callback is swallowed.

    After a failed round trip the thread wakes no later than the slot's deadline, so the
    loss is declared the moment a whole lease has passed without a renewal that succeeded.
    The thread is started by :meth:`start`, never on construction, so a slot acquired before
    a fork does not leave a thread behind in the parent.
    """

    def __init__(
        self, slot: Slot, interval: float, on_renew_error: RenewErrorCallback | None = None
    ) -> None:
        self._slot = slot
        self._share = interval / slot.lease
        self._on_renew_error = on_renew_error
        self._stop = threading.Event()
        # Set by whichever comes first: a round trip answering, or stop().
        self._wake = threading.Event()
        # Set by stop() and by a change of the slot's lease: the loop then re-plans its wait.
        self._nudge = threading.Event()
        slot.watch_lease(self._nudge.set)
        self._thread = threading.Thread(target=self._loop, name="semaphore-heartbeat", daemon=True)

    def start(self) -> None:
        """Start renewing in the background."""
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and wait for the heartbeat thread to end.

        Returns at once even if a renewal round trip is still in flight: that round trip is
        abandoned, and its answer can no longer mark the slot lost.
        """
        self._stop.set()
        self._wake.set()
        self._nudge.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        slot = self._slot
        # Renewals are planned from when the last one was *sent* (the acquire, at first), so a
        # slow reply does not push the next renewal towards the deadline.
        last_sent = slot.renewed_at
        while True:
            next_tick = last_sent + self._share * slot.lease
            if self._nudge.wait(max(0.0, min(next_tick, slot.deadline) - time.monotonic())):
                self._nudge.clear()
                if self._stop.is_set():
                    return
                # The lease changed: renew at once, so that a renewal of the old lease still
                # in flight cannot be the last word Redis hears.
            if self._stop.is_set():
                return
            if slot.lost.is_set() or slot.released:
                return  # lost already, or given back by the body itself
            if time.monotonic() >= slot.deadline:
                slot.mark_lost("no renewal succeeded within one lease")
                return
            last_sent = time.monotonic()
            if not self._tick():
                return

    def _tick(self) -> bool:
        """One renewal. False when renewing is over (the slot is lost, or we were stopped)."""
        slot = self._slot
        self._wake.clear()
        if self._stop.is_set():
            return False
        trip = _RoundTrip(slot, self._wake)
        self._wake.wait(max(0.0, slot.deadline - time.monotonic()))
        if self._stop.is_set():
            return False
        if not self._wake.is_set():
            slot.mark_lost("a renewal got no answer within one lease")
            return False
        if trip.error is not None:
            self._report(trip.error)
            return True  # the loop wakes again by the deadline at the latest
        if not trip.ok:
            if slot.released:
                return False  # the body released the slot while this renewal was in flight
            slot.mark_lost("a renewal found the slot gone")
            return False
        return True

    def _report(self, error: BaseException) -> None:
        if self._on_renew_error is None:
            return
        # A broken telemetry hook must not stop renewal.
        with contextlib.suppress(Exception):
            self._on_renew_error(error)
