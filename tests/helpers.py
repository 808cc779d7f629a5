"""Independent measurement for tests: counts bodies in flight without the library's help."""

from __future__ import annotations

import threading


class InFlight:
    """Counts concurrent bodies with a lock of its own and remembers the peak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0
        self.entered = 0

    def __enter__(self) -> InFlight:
        with self._lock:
            self.current += 1
            self.entered += 1
            self.peak = max(self.peak, self.current)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.current -= 1
