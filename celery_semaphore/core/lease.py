"""The lease bookkeeping a held slot keeps, the same for the sync
:class:`~celery_semaphore.core.slot.Slot` and the asyncio
:class:`~celery_semaphore.asyncio.slot.AsyncSlot`: when the lease surely runs out, and how a
renewal's answer moves it on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import SemaphoreLeaseLostError
from .process import token_of
from .replies import Admitted

RenewErrorCallback = Callable[[BaseException], object]
"""Called with each renewal round trip that failed without saying the slot is gone."""


class LeaseRecord:
    """A held slot's identity and lease clock; see :class:`~celery_semaphore.core.slot.Slot`
    for the attributes.

    Args:
        key (str): the semaphore's key.
        limit (int): the limit the slot was taken under.
        token (str): the acquisition's member (see :func:`.process.member_of`);
            :attr:`token` is the token it starts with.
        lease (float): seconds the slot lives without an extend.
        admitted (Admitted): the acquire's answer (expiry and server time, ms).
        sent_at (float): ``time.monotonic()`` when that acquire was sent.
        weight (int): how many units of the limit the slot takes.
    """

    def __init__(
        self,
        key: str,
        limit: int,
        token: str,
        lease: float,
        admitted: Admitted,
        sent_at: float,
        weight: int = 1,
    ) -> None:
        self.key = key
        self.weight = weight
        # The limit that applied, as the script answered it (a live limit wins over the
        # caller's; see set_limit.lua).
        self.limit = admitted.limit or limit
        # The store knows the holder by its member (process.py): the token and, for a plain
        # acquire, the holder's record after it; views and operators know it by its token.
        self._member = token
        self.token = token_of(token)
        self.lease = lease
        self.acquired_at = admitted.now_ms / 1000
        self.expires_at = admitted.expires_at_ms / 1000
        # Local monotonic time at which the last successful acquire/extend was *sent*: the
        # lease began no earlier than that, so the slot is surely ours until `deadline`. (A
        # resent acquire is answered with the slot the first one took, whose lease may end
        # sooner: the deadline is then moved up to match.)
        left = (admitted.expires_at_ms - admitted.now_ms) / 1000
        self._renewed_at = sent_at - max(0.0, lease - left)
        # When the extend that set the current lease was sent: an older reply must not undo it.
        self._lease_sent_at = sent_at
        self._lost_reason = ""
        # Set by a renewer, so that a changed lease re-plans its next renewal.
        self._on_lease_change: Callable[[], object] | None = None

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` by which a renewal must succeed, or the slot counts as lost:
        one lease after the last successful acquire or extend was *sent*."""
        return self._renewed_at + self.lease

    def _watch_lease(self, callback: Callable[[], object] | None) -> None:
        """Call ``callback()`` whenever an extend changes the lease (a renewer re-plans);
        None stops it."""
        self._on_lease_change = callback

    def _renewed(self, sent_at: float, seconds: float, expires_at_ms: int | None) -> bool:
        """Take in the answer to a renewal sent at ``sent_at`` (``time.monotonic()``) for
        ``seconds``: True when the slot is still ours. It does not mark the slot lost on
        False (the caller decides)."""
        if expires_at_ms is None:
            return False
        self._renewed_at = max(self._renewed_at, sent_at)
        if sent_at < self._lease_sent_at:
            return True  # a later extend has already set the lease; this reply is stale
        changed = seconds != self.lease
        self._lease_sent_at = sent_at
        self.lease = seconds
        self.expires_at = expires_at_ms / 1000
        if changed and self._on_lease_change is not None:
            self._on_lease_change()
        return True

    def lease_lost_error(self) -> SemaphoreLeaseLostError:
        """The error that reports this slot's loss, naming why it was judged lost."""
        reason = self._lost_reason or "the slot was lost"
        return SemaphoreLeaseLostError(
            f"semaphore {self.key!r} (limit {self.limit}): {reason} while its body ran",
            self.key,
            self.limit,
        )


S = TypeVar("S", bound=LeaseRecord)


@dataclass(eq=False)
class RenewalPlan(Generic[S]):
    """One slot registered with a renewer (sync or asyncio), and when to renew it next.

    Attributes:
        slot: the slot.
        share (float): the renewal interval as a share of the lease, kept when the lease
            changes, so a shorter lease is renewed sooner.
        on_error (RenewErrorCallback | None): see :meth:`Semaphore.hold`.
        last_sent (float): ``time.monotonic()`` of the last renewal sent (the acquire, at
            first).
    """

    slot: S
    share: float
    on_error: RenewErrorCallback | None
    last_sent: float

    @property
    def interval(self) -> float:
        """Seconds between renewals, for the slot's current lease."""
        return self.share * self.slot.lease

    @property
    def next_tick(self) -> float:
        """``time.monotonic()`` of the next renewal."""
        return self.last_sent + self.interval
