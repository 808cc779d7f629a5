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
from .calls import block_call
from .options import AcquirePlan
from .replies import Admitted
from .scripts import Scripts, backend_errors

MAX_BLOCK = 2.0
"""Longest single BLPOP, seconds: under the 5 s socket timeout of clients made from a URL."""

S = TypeVar("S")


def wait_for_slot(
    scripts: Scripts, client: redis.Redis, plan: AcquirePlan, make: Callable[[Admitted, float], S]
) -> S | None:
    """After ``plan``'s acquire found the key full, block for up to ``plan.wait`` seconds
    until a release wakes this caller, then take the slot ``plan`` asks for (a call a start
    rate refused blocks until the rate allows it); ``make``'s slot, or None when the time
    is up.

    Raises:
        SemaphoreBackendError: Redis failed.
    """
    give_up = time.monotonic() + plan.wait
    try:
        while (remaining := give_up - time.monotonic()) > 0:
            with backend_errors(plan.key, plan.limit):
                # Registered before asking again: a release in between pushes a wake.
                now_ms = scripts.run(block_call(plan.keys, plan.token, math.ceil(remaining * 1000)))
                sent_at = time.monotonic()
                reply = scripts.acquire(plan.keys, plan.limit, plan.ms, plan.token, plan.weight,
                                        plan.rated)  # fmt: skip
                if isinstance(reply, Admitted):
                    return make(reply, sent_at)
                lapse = reply.first_lapse(now_ms)
                client.blpop([plan.keys.wake], timeout=min(remaining, lapse, MAX_BLOCK))
        return None
    finally:
        with contextlib.suppress(SemaphoreBackendError), backend_errors(plan.key, plan.limit):
            client.zrem(plan.keys.blocked, plan.token)
