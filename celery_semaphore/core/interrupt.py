"""Opt-in: stop a running body the moment its slot is lost.

CPython can raise an exception in another thread at that thread's next bytecode
(``PyThreadState_SetAsyncExc``). When a slot is lost, the heartbeat thread uses it to raise
:class:`LeaseInterrupted` in the thread running the body. A body blocked inside C code (a
socket read, ``time.sleep``) sees it only when control returns to Python, and the final
deadline check still reports the loss if it never does.
"""

from __future__ import annotations

import ctypes
import threading

from ..errors import LeaseInterrupted
from .group import SlotGroup
from .slot import Slot


def _raise_in(thread_id: int, exc_type: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else None
    )


class Interrupter:
    """While entered, a loss of ``slot`` raises :class:`LeaseInterrupted` in this thread.

    Args:
        slot (Slot | SlotGroup): the slot to watch (or the slots of several keys).
    """

    def __init__(self, slot: Slot | SlotGroup) -> None:
        self._slot = slot
        self._lock = threading.Lock()
        self._thread_id: int | None = None

    def __enter__(self) -> Interrupter:
        self._thread_id = threading.get_ident()
        self._slot.when_lost(self._fire)
        return self

    def _fire(self, slot: object) -> None:
        with self._lock:
            if self._thread_id is not None:
                _raise_in(self._thread_id, LeaseInterrupted)

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        with self._lock:
            thread_id, self._thread_id = self._thread_id, None
            if thread_id is not None and exc_type is None:
                # The body finished first: drop an interrupt that has not been raised yet,
                # so it cannot land in the code that runs after the body.
                _raise_in(thread_id, None)
