"""The Celery glue: put a semaphore slot in front of a task's runs.

Modules, bottom up: ``policy`` (the options, no Celery), ``store`` (which Redis, as Celery
reads its settings), ``settings`` (the ``semaphore_*`` settings resolved per app), ``keys``
(key templates), ``signals`` (what a run announces), ``stats`` (per-worker counters),
``shedding`` (publish a run again with a countdown), ``room`` (park a run in the waiting room,
claim a hand-off), ``runner`` (run a body under a slot), ``task`` and ``decorators`` (the two
ways in), ``worker`` (bootstep, inspect command, dead-run release, and the worker's upkeep
thread that checks the store and sweeps the rooms).
"""

# Imported for its effects: the inspect command, and the receiver that adds the bootstep.
from . import worker as _worker  # noqa: F401
from .current import current_slot
from .decorators import bounded
from .task import SemaphoreTask

__all__ = ["SemaphoreTask", "bounded", "current_slot"]
