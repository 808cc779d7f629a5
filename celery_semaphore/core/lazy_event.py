"""A :class:`threading.Event` that allocates its condition only when someone waits on it.

Every held slot has a ``lost`` event, yet almost none is ever waited on: most are only set
(rarely) or asked ``is_set()``. A plain ``threading.Event`` builds a ``Condition`` and its
lock up front, which costs more than the rest of a slot; :class:`LazyEvent` builds them on
the first :meth:`~LazyEvent.wait`.
"""

from __future__ import annotations

import os
import threading

_MAKING = threading.Lock()
"""Guards the flag and the making of a condition, for every lazy event (short sections)."""


def _after_fork() -> None:
    # A thread of the parent may have held the lock at the fork; the child has no such thread.
    global _MAKING
    _MAKING = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


class LazyEvent(threading.Event):
    """A ``threading.Event`` (same methods, same meaning) whose condition is made by the
    first :meth:`wait`."""

    def __init__(self) -> None:  # no super().__init__(): that is the allocation it saves
        self._flag = False
        self._lazy: threading.Condition | None = None

    def is_set(self) -> bool:
        """Whether the flag is set."""
        return self._flag

    def set(self) -> None:
        """Set the flag and wake every waiter."""
        with _MAKING:
            self._flag = True
            cond = self._lazy
        if cond is not None:
            with cond:
                cond.notify_all()

    def clear(self) -> None:
        """Reset the flag."""
        with _MAKING:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set, or ``timeout`` seconds pass; the flag on return."""
        with _MAKING:
            if self._flag:
                return True
            if self._lazy is None:
                self._lazy = threading.Condition(threading.Lock())
            cond = self._lazy
        with cond:
            # A set() between the two sections notified before this wait: read the flag.
            if not self._flag:
                cond.wait(timeout)
            return self._flag
