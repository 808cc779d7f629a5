"""``@bounded`` on an ``async def``: the coroutine's call holds a slot of the same key as the
app's tasks, through an :class:`~celery_semaphore.asyncio.AsyncSemaphore`.

Celery does not run coroutines as tasks, so a bounded coroutine function is always a plain
call, made from an event loop (a web handler, say). It counts against the same slots as the
app's tasks because everything that names a slot comes from the same place: the key
(:class:`~.keys.KeyTemplate`), the limit, the app's ``semaphore_prefix``, and the Redis of
its ``semaphore_url`` (or broker, or result backend), reached through an asyncio twin of the
tasks' own client. Each event loop gets its own semaphore and client, since ``redis.asyncio``
connections belong to the loop that opened them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import redis
from celery import Celery
from celery._state import get_current_app
from redis import asyncio as aioredis

from ..asyncio import AsyncSemaphore, async_client_from_url, async_client_like
from ..asyncio.clients import AsyncClient
from ..asyncio.guard import guard
from ..core import validation as check
from ..core.admin import DEFAULT_PREFIX
from ..core.feedback import BackOff
from ..core.refusals import is_paused_async, not_acquired
from ..errors import SemaphoreValidationError
from .asks import ask_for
from .current import UNBOUNDED
from .limits import LimitSpec
from .policy import Policy
from .runner import Runner
from .settings import app_settings, client_for
from .waiting_room.handoffs import publisher_for

CoroutineFunction = Callable[..., Coroutine[Any, Any, Any]]


class CoroutineRunner:
    """Runs calls of one bounded coroutine function under a slot.

    Args:
        runner (Runner): the function's key, limit, options, app and Redis, checked as for
            a sync function.
    """

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        # Per event loop, per app (None: no app): a loop that is collected takes its
        # semaphores, and their clients, with it.
        self._made: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop,
            dict[Celery | None, tuple[AsyncSemaphore, Policy, LimitSpec]],
        ] = weakref.WeakKeyDictionary()

    def wrap(self, fn: CoroutineFunction) -> CoroutineFunction:
        """``fn`` wrapped to run under this semaphore; the wrapper keeps ``fn``'s signature."""

        @functools.wraps(fn)
        async def run_bounded(*args: Any, **kwargs: Any) -> Any:
            return await self.call(fn, args, kwargs)

        run_bounded.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        return run_bounded

    def resolve(self, app: Celery | None) -> tuple[AsyncSemaphore, Policy, LimitSpec]:
        """The running loop's semaphore, the effective policy and the limit option for calls
        under ``app``.

        Raises:
            SemaphoreValidationError: as :meth:`Runner.resolve`.
            RuntimeError: no event loop is running.
        """
        made = self._made.setdefault(asyncio.get_running_loop(), {})
        found = made.get(app)
        if found is None:
            policy, limits = self.runner.policy_and_limits(app)
            semaphore = AsyncSemaphore(
                self._client(app),
                limits.adaptive or limits.default,
                policy.lease,
                DEFAULT_PREFIX if app is None else app_settings(app).prefix,
                claim_timeout=policy.claim_timeout,
                on_handoff=None if app is None else publisher_for(app),
                handoff_grace=policy.handoff_grace,
                rate=policy.rates,
                max_cool_down=policy.max_cool_down,
            )
            found = made[app] = (semaphore, policy, limits)
        return found

    def _client(self, app: Celery | None) -> AsyncClient:
        given = self.runner.redis
        if given is None:
            assert app is not None  # _call picks the current app when no redis is given
            return async_client_like(client_for(app))
        if isinstance(given, str):
            return async_client_from_url(given)
        if isinstance(given, (redis.Redis, redis.RedisCluster)):
            return async_client_like(given)
        if isinstance(given, (aioredis.Redis, aioredis.RedisCluster)):
            return given
        raise SemaphoreValidationError(
            f"redis must be a redis-py client (sync or asyncio) or a URL, got {given!r:.80}"
        )

    async def call(self, fn: CoroutineFunction, args: tuple[Any, ...], kwargs: Any) -> Any:
        """Await ``fn(*args, **kwargs)`` holding a slot; see :func:`bounded` for the rules.

        Raises:
            SemaphoreNotAcquiredError: every slot was held (after the retries or the wait).
            SemaphoreLeaseLostError: the slot was lost while the body ran.
        """
        if UNBOUNDED:
            return await fn(*args, **kwargs)
        runner = self.runner
        named = runner.app is not None or runner.redis is not None
        semaphore, policy, limits = self.resolve(runner.app if named else get_current_app())
        ask = ask_for(runner.template, limits, runner.weights, args, kwargs, rates=policy.rates)
        wait = policy.wait_timeout if policy.on_full == "wait" else 0.0
        interval = check.heartbeat_interval(policy.heartbeat, policy.lease)
        slot = await semaphore.acquire(
            ask.key, limit=ask.limit, weight=ask.weight, retries=0 if wait else runner.retries,
            retry_delay=runner.retry_delay, wait=wait, units=ask.units,
        )  # fmt: skip
        if slot is None:
            paused = await is_paused_async(semaphore.admin, ask.key)
            raise not_acquired(ask.key, ask.limit, wait, paused=paused)
        async with guard(slot, interval, interrupt=policy.interrupt):
            try:
                return await fn(*args, **kwargs)
            except policy.back_off_types as exc:  # the guard backs off on BackOff
                raise BackOff.from_error(exc) from exc
