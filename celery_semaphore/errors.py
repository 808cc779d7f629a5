"""The exceptions celery-semaphore raises.

Every error derives from one base, so ``except SemaphoreError`` catches them all::

    SemaphoreError                      base; .key and .limit where they apply
    ├── SemaphoreValidationError        bad input, raised before anything touches Redis
    │                                   (also a ValueError)
    ├── SemaphoreNotAcquiredError       no slot was had; .reason says why (a Refusal)
    ├── SemaphoreLeaseLostError         a slot was lost while its body ran
    │   └── LeaseInterrupted            raised inside a body stopped by interrupt=True
    ├── SemaphoreRunLostError           a parked run the store lost that cannot run again
    └── SemaphoreBackendError           Redis failed; the redis-py error is __cause__

Errors must survive pickling, because Celery ships a task's exception to the result backend
and to the client that waits on it; each class therefore keeps its arguments positional and
defines ``__reduce__``.
"""

from __future__ import annotations

import enum
from typing import Any


class SemaphoreError(Exception):
    """Base class of every error this package raises.

    Args:
        message (str): what went wrong, for a person.
        key (str | None): the semaphore's key, where one applies.
        limit (int | None): the semaphore's limit, where one applies.
    """

    def __init__(self, message: str, key: str | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.limit = limit

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.key, self.limit))

    def __str__(self) -> str:
        return self.message


class SemaphoreValidationError(SemaphoreError, ValueError):
    """An argument or setting is invalid. Raised before any Redis command is sent."""


class Refusal(str, enum.Enum):
    """Why a run or a caller got no slot: the ``reason`` of a
    :class:`SemaphoreNotAcquiredError`, of the ``semaphore_refused`` signal and of the
    ``semaphore_refused_total`` metric. A ``str``, so ``error.reason == "timeout"`` holds.
    """

    FULL = "full"
    """Every slot was held on each attempt it was allowed: at once (``on_full="raise"``, no
    ``retries``), after its ``retries``, or after ``shed_max_retries`` sheds."""
    TIMEOUT = "timeout"
    """Its wait budget in seconds is spent: ``wait=`` of a call, ``queue_timeout`` of a
    parked run, ``shed_timeout`` of a shedding one, or the wait of a run outside a worker."""
    BACKEND = "backend"
    """The store could not be reached until the shed budget was spent: the run fails closed
    rather than run unbounded."""
    ROOM_FULL = "room_full"
    """The key's waiting room already held ``max_queued`` runs."""
    SHUTDOWN = "shutdown"
    """The semaphore was closed (``AsyncSemaphore.aclose``) while the call waited."""
    PAUSED = "paused"
    """An operator paused the key (``celery semaphore pause``, ``SemaphoreAdmin.pause``):
    nothing new starts on it until it is resumed."""
    BACK_OFF = "backoff"
    """The provider said it is over its limit (a body raised ``BackOff`` or one of its
    ``back_off_on`` exceptions): with ``on_full="raise"``, or past ``max_back_offs``."""

    def __str__(self) -> str:
        return self.value


class SemaphoreNotAcquiredError(SemaphoreError):
    """No slot of ``key`` was had; :attr:`reason` says why.

    Raised by :meth:`Semaphore.hold` and :meth:`Semaphore.run` (``acquire`` returns ``None``
    instead), and by Celery tasks whose ``on_full`` is ``"raise"``, whose wait or shed budget
    (``queue_timeout``, ``shed_timeout``, ``shed_max_retries``) is spent, whose store stayed
    out of reach, or whose key's waiting room already holds ``max_queued`` runs.

    Args:
        message (str): what went wrong, for a person.
        key (str | None): the semaphore's key (several joined with ``+``).
        limit (int | None): its limit.
        reason (Refusal | str): why, one of :class:`Refusal` or its value. Default
            ``Refusal.FULL``.

    Attributes:
        reason (Refusal): why no slot was had.

    Raises:
        ValueError: ``reason`` is not one of :class:`Refusal`.
    """

    def __init__(
        self,
        message: str,
        key: str | None = None,
        limit: int | None = None,
        reason: Refusal | str = Refusal.FULL,
    ) -> None:
        super().__init__(message, key, limit)
        self.reason = Refusal(reason)
        # Celery stores an exception's args (as JSON, by default) and builds it again from
        # them for AsyncResult.get(): in the args, the reason reaches the caller that waits.
        self.args = (message, key, limit, self.reason.value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)


class SemaphoreLeaseLostError(SemaphoreError):
    """A slot was lost while its body ran: the semaphore may have admitted one caller too many.

    Raised even when the body itself succeeded, since its result was produced outside the
    bound it was written against. Raise the lease if this recurs.
    """


class SemaphoreBackendError(SemaphoreError):
    """A Redis command failed (connection refused, timeout, wrong type of key, ...).

    The redis-py exception is kept as ``__cause__``.
    """


class LeaseInterrupted(SemaphoreLeaseLostError):
    """Raised inside a body whose slot was lost, when ``interrupt`` is on.

    The bounded task turns it into a :class:`SemaphoreLeaseLostError` naming the key.
    """

    def __init__(
        self,
        message: str = "slot lost: body interrupted",
        key: str | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(message, key, limit)


class SemaphoreRunLostError(SemaphoreError):
    """A parked run that the semaphore store lost (a restart without persistence, say), and
    that could not be sent again from its host's journal: it is stored as this run's
    failure, so that ``AsyncResult.get()`` raises instead of waiting for ever."""
