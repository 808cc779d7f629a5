"""``acquire(wait=...)``: block until a release frees a slot, without polling.

A caller that found its key full registers its token as blocked (``block.lua``) and then
blocks on the key's wake list (BLPOP). A release that frees a slot the waiting room does not
take pushes one element there (``release.lua``), which wakes one blocked caller to try again.
Each block also ends at the soonest lease to lapse (a crashed holder frees its slot then,
and nobody pushes) and after :data:`MAX_BLOCK` seconds.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from ..errors import SemaphoreBackendError
from . import validation as check
from .calls import block_call
from .names import Keys
from .replies import Admitted
from .scripts import Scripts, backend_errors

MAX_BLOCK = 2.0
"""Longest single BLPOP, seconds: under the 5 s socket timeout of clients made from a URL."""

S = TypeVar("S")


def wait_for_slot(
    scripts: Scripts,
    client: redis.Redis,
    keys: Keys,
    key: str,
    token: str,
    lease: float,
    wait: float,
    limit: int,
    weight: int,
    make: Callable[[Admitted, float], S],
    rated: tuple[str | int, ...] = (),
) -> S | None:
    """After an acquire found the key full, block for up to ``wait`` seconds until a
    release wakes this caller, then take a slot (``weight`` units of ``limit`` for ``lease``
    seconds, under the start rates ``rated``, when given: a call a
    rate refused blocks until the rate allows it); ``make``'s slot, or None when the time
    is up.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    ms = check.lease_ms(lease)
    give_up = time.monotonic() + wait
    try:
        while (remaining := give_up - time.monotonic()) > 0:
            with backend_errors(key, limit):
                # Registered before asking again: a release in between pushes a wake.
                now_ms = scripts.run(block_call(keys, token, math.ceil(remaining * 1000)))
                sent_at = time.monotonic()
                reply = scripts.acquire(keys, limit, ms, token, weight, rated)
                if isinstance(reply, Admitted):
                    return make(reply, sent_at)
                lapse = reply.first_lapse(now_ms)
                client.blpop([keys.wake], timeout=min(remaining, lapse, MAX_BLOCK))
        return None
    finally:
        with contextlib.suppress(SemaphoreBackendError), backend_errors(key, limit):
            client.zrem(keys.blocked, token)
