"""The exceptions celery-semaphore raises.

Every error derives from one base, so ``except SemaphoreError`` catches them all::

    SemaphoreError                      base; .key and .limit where they apply
    ├── SemaphoreValidationError        bad input, raised before anything touches Redis
    │                                   (also a ValueError)
    ├── SemaphoreNotAcquiredError       every slot was taken (after any retries)
    ├── SemaphoreLeaseLostError         a slot was lost while its body ran
    │   └── LeaseInterrupted            raised inside a body stopped by interrupt=True
    └── SemaphoreBackendError           Redis failed; the redis-py error is __cause__

Errors must survive pickling, because Celery ships a task's exception to the result backend
and to the client that waits on it; each class therefore keeps its arguments positional and
defines ``__reduce__``.
"""

from __future__ import annotations

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


class SemaphoreNotAcquiredError(SemaphoreError):
    """Every slot of ``key`` was held by others, on the first try and on each retry.

    Raised by :meth:`Semaphore.hold` and :meth:`Semaphore.run` (``acquire`` returns ``None``
    instead), and by Celery tasks whose ``on_full`` is ``"raise"``, whose wait or shed budget
    (``shed_timeout``, ``shed_max_retries``) is spent, or whose key's waiting room already
    holds ``max_queued`` runs.
    """


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
