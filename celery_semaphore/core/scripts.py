"""The Redis side of the semaphore: Lua scripts and the replies they give.

Each operation is one Lua script (``lua/*.lua``, each opening with its contract), registered
as a redis-py :class:`~redis.commands.core.Script` and run by one EVALSHA round trip, loaded
again after a NOSCRIPT (a restarted or failed-over server). Each call is built
once as a :class:`Call` (:mod:`celery_semaphore.core.calls`: the script, its KEYS and ARGV,
and the pure function of :mod:`celery_semaphore.core.replies` that reads its reply), which
:class:`Scripts` sends through a redis-py client and :class:`AsyncScripts` through a
``redis.asyncio`` one; :class:`Scripts` sends acquire and release without building one. This
module also maps redis-py errors to :class:`SemaphoreBackendError` (the keys are named in
:mod:`celery_semaphore.core.names`); what a reply *means* for a holder is decided in
:mod:`celery_semaphore.core.slot` and :mod:`celery_semaphore.core.semaphore`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, TypeVar

import redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio import RedisCluster as AsyncRedisCluster
from redis.exceptions import NoScriptError, RedisClusterException

from ..errors import SemaphoreBackendError
from . import calls
from .calls import ROOM_KEYS, SCRIPT_KEYS, Call, acquire_argv, release_argv
from .names import Keys, keys_named
from .replies import (
    Admitted,
    Full,
    Handoff,
    Released,
    parse_acquire,
    parse_release,
)

T = TypeVar("T")


_USES = re.compile(r"^--! uses: (.*)$", re.MULTILINE)
_VARIANTS = {"acquire_rated": ("acquire", "rates"), "take_rated": ("take", "rates")}
"""Scripts sent as another file with one more helper: the plain ``acquire`` and ``take``, the
hot paths, never take the branch that calls the start rates' steps and do not carry them."""


class Source:
    """One script's text as sent, composed from its ``lua/*.lua`` file and the helper files
    it names: a line ``--! uses: a b`` is replaced, where it stands, by ``a.lua`` and
    ``b.lua`` (each with its own ``uses`` line replaced in turn, and each at most once per
    script), so a script can keep the helpers below a fast path that never needs them.
    :meth:`where` maps a line of the text back to the file and line it came from, for Lua's
    errors (which count lines in the text sent).

    Args:
        name (str): the script's name: its file's, or one of :data:`_VARIANTS`.
    """

    def __init__(self, name: str) -> None:
        file, extra = _VARIANTS.get(name, (name, ""))
        self._spans: list[tuple[int, str, int]] = []  # (first line here, file, its line)
        lines: list[str] = []
        self._add(file, lines, {file}, extra)
        self.text = "\n".join(lines)

    def _add(self, file: str, lines: list[str], seen: set[str], extra: str = "") -> None:
        text = resources.files(__package__).joinpath("lua", f"{file}.lua").read_text("utf-8")
        for number, line in enumerate(text.split("\n"), 1):
            if not self._spans or self._spans[-1][1] != file:
                self._spans.append((len(lines) + 1, file, number))
            lines.append(line)  # a "uses" line too: a comment, which keeps the count
            uses = _USES.match(line)
            if uses is None:
                continue
            for helper in f"{extra} {uses.group(1)}".split():
                if helper not in seen:
                    seen.add(helper)
                    self._add(helper, lines, seen)
            extra = ""

    def where(self, line: int) -> str:
        """``"<file>.lua:<line>"``: where line ``line`` (1-based) of :attr:`text` comes from."""
        first, file, at = max(span for span in self._spans if span[0] <= line)
        return f"{file}.lua:{at + line - first}"


def located(exc: redis.ResponseError, script: str) -> redis.ResponseError:
    """``exc``, a Lua error of ``script``, with the file and line it points at added (Redis
    counts lines in the composed text, which no file holds)."""
    found = re.search(r"user_script:(\d+)", str(exc))
    if found is None or script not in _SOURCES:
        return exc
    return type(exc)(f"{exc} [at lua/{_SOURCES[script].where(int(found.group(1)))}]")


_SOURCES = {name: Source(name) for name in SCRIPT_KEYS}
_NAMES_KEPT = 4096
"""Semaphore keys whose encoded names a :class:`Scripts` keeps (then it starts afresh)."""


class _Names:
    """A semaphore's Redis key names, encoded once (see :meth:`Scripts._encoded`), and the
    head of an acquire's and of a release's EVALSHA arguments: the number of keys and the
    keys, ready to send."""

    __slots__ = ("acquire", "names", "release")

    def __init__(self, names: tuple[bytes, ...]) -> None:
        self.names = names
        taken, freed = names[SCRIPT_KEYS["acquire"]], names[ROOM_KEYS]
        # The key count stays an int: redis-py 5.0's cluster client (our lowest) reads it as one
        # to find the keys (and so the node) of an EVALSHA.
        self.acquire: tuple[int | bytes, ...] = (len(taken), *taken)
        self.release: tuple[int | bytes, ...] = (len(freed), *freed)


class backend_errors:
    """Re-raise any redis-py error inside the block as :class:`SemaphoreBackendError`.

    A class rather than a generator-based context manager: it wraps every round trip, and
    entering one costs a third as much.

    Args:
        key (str): the semaphore's key, for the error.
        limit (int | None): its limit, for the error.
    """

    __slots__ = ("key", "limit")

    def __init__(self, key: str, limit: int | None = None) -> None:
        self.key = key
        self.limit = limit

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if isinstance(exc, REDIS_ERRORS):
            raise backend_error(exc, self.key, self.limit) from exc


REDIS_ERRORS = (redis.RedisError, RedisClusterException)
"""What redis-py raises when Redis fails; the hot path catches them itself, with
``except REDIS_ERRORS as exc: raise backend_error(exc, ...) from exc``, which costs nothing
until one is raised (a :class:`backend_errors` block is an object made per round trip)."""


def backend_error(exc: BaseException, key: str, limit: int | None) -> SemaphoreBackendError:
    """The :class:`SemaphoreBackendError` that reports ``exc`` (a redis-py error) for the
    semaphore ``key`` of ``limit``; the caller raises it ``from exc``."""
    return SemaphoreBackendError(
        f"Redis failed for semaphore {key!r}: {type(exc).__name__}: {exc}", key, limit
    )


class Scripts:
    """The semaphore's scripts, registered once on one redis-py client.

    Args:
        client (redis.Redis): the client every call goes through.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._scripts = {name: client.register_script(src.text) for name, src in _SOURCES.items()}
        self._shas = {name: script.sha.encode() for name, script in self._scripts.items()}
        self._execute: Callable[..., Any] = client.execute_command
        encoder = client.get_encoder()
        self._encoding: tuple[str, str] = (encoder.encoding, encoder.encoding_errors)
        self._names: dict[Keys, _Names] = {}

    def _encoded(self, keys: Keys) -> _Names:
        """``keys`` encoded as the client encodes them, once per semaphore key: redis-py
        encodes every argument of every call, and the keys are most of a release's."""
        found = self._names.get(keys)
        if found is None:
            if len(self._names) >= _NAMES_KEPT:
                self._names.clear()
            found = self._names[keys] = _Names(tuple(n.encode(*self._encoding) for n in keys))
        return found

    def _send(self, name: str, args: tuple[str | int | bytes, ...]) -> Any:
        """``EVALSHA <sha of name> *args`` (``args`` open with the number of keys); after a
        NOSCRIPT (a restarted or failed-over server), loads the script and sends again.

        Sent with the client's ``execute_command`` rather than through redis-py's
        ``Script``, whose own checks cost more than the rest of an acquire's client side,
        or its ``evalsha``, two calls deeper; the SHA goes as bytes, which redis-py sends
        as they are."""
        try:
            try:
                return self._execute("EVALSHA", self._shas[name], *args)
            except NoScriptError:  # the SHA stays: the text's SHA1, computed on registering
                self.client.script_load(self._scripts[name].script)
                return self._execute("EVALSHA", self._shas[name], *args)
        except redis.ResponseError as exc:
            raise located(exc, name) from exc

    def run(self, call: Call[T]) -> T:
        """Send ``call`` (one EVALSHA round trip) and return its parsed reply."""
        return call.parse(self._send(call.script, (len(call.keys), *call.keys, *call.args)))

    def run_many(self, calls: Sequence[Call[T]]) -> list[T | Exception]:
        """Send ``calls`` in one pipelined round trip (not a transaction: each runs on its
        own, atomically); after a NOSCRIPT, load the script and send those again.

        Returns:
            list[T | Exception]: each call's parsed reply, or the error the server answered
            it with (a :class:`redis.ResponseError`), in order.

        Raises:
            redis.RedisError: the round trip failed: which calls ran is not known.
        """
        replies = self._pipelined(calls)
        again = [n for n, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        for name in {calls[n].script for n in again}:
            self.client.script_load(self._scripts[name].script)
        for n, reply in zip(again, self._pipelined([calls[n] for n in again]), strict=True):
            replies[n] = reply
        return [
            located(reply, call.script) if isinstance(reply, redis.ResponseError)
            else reply if isinstance(reply, Exception) else call.parse(reply)
            for call, reply in zip(calls, replies, strict=True)
        ]  # fmt: skip

    def _pipelined(self, calls: Sequence[Call[Any]]) -> list[Any]:
        if not calls:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            send: Callable[..., Any] = pipe.execute_command
            for call in calls:
                send("EVALSHA", self._shas[call.script], len(call.keys), *call.keys, *call.args)
            return list(pipe.execute(raise_on_error=False))

    def acquire(
        self, keys: Keys, limit: int, lease_ms: int, token: str, weight: int = 1,
        rated: tuple[str | int, ...] = (),
    ) -> Admitted | Full:  # fmt: skip
        """Take ``weight`` units if the live holders leave that many and every start rate
        (``rated``: :func:`.rates.acquire_rates`) allows it (one round trip)."""
        args = acquire_argv(limit, lease_ms, token, weight, rated)
        reply = self._send(
            "acquire_rated" if rated else "acquire", self._encoded(keys).acquire + args
        )
        return parse_acquire(reply, limit, lease_ms)

    def release(
        self, keys: Keys, token: str, claim_ms: int, weight: int | None = 1,
        verdict: tuple[str, ...] = (),
    ) -> Released:  # fmt: skip
        """Remove ``token`` (see :func:`release_call`)."""
        args = release_argv(token, claim_ms, weight, verdict)
        return parse_release(self._send("release", self._encoded(keys).release + args))

    def cancel(self, keys: Keys, waiter: str, claim_ms: int) -> tuple[bool, list[Handoff]]:
        """Take ``waiter`` out of the room (see :func:`~.calls.cancel_call`); a waiter of
        several keys out of all of their rooms at once, which costs a second round trip."""
        found, handed, every = self.run(calls.cancel_call([keys], waiter, claim_ms))
        if every:
            found, handed, _ = self.run(
                calls.cancel_call([keys_named(slots) for slots in every], waiter, claim_ms)
            )
        return found, handed


class AsyncScripts:
    """The same scripts, registered once on one ``redis.asyncio`` client (plain or cluster).

    Calls are built by the same ``*_call`` functions as :class:`Scripts`'s, so the sync and
    the asyncio semaphore share one set of scripts and one reading of every reply.

    Args:
        client (redis.asyncio.Redis | redis.asyncio.RedisCluster): the client every call
            goes through.
    """

    def __init__(self, client: AsyncRedis | AsyncRedisCluster) -> None:
        self.client = client
        self._scripts = {name: client.register_script(src.text) for name, src in _SOURCES.items()}
        # redis-py's asyncio cluster client fails commands sent at once before it has read
        # the slot map, so a cluster client is initialised once, before its first call.
        self._unready = isinstance(client, AsyncRedisCluster)
        self._initialising = asyncio.Lock()

    async def run(self, call: Call[T]) -> T:
        """Send ``call`` (one EVALSHA round trip) and return its parsed reply."""
        if self._unready:
            async with self._initialising:
                if self._unready:
                    await self.client.initialize()
                    self._unready = False
        try:
            reply = await self._scripts[call.script](keys=call.keys, args=call.args)
        except redis.ResponseError as exc:
            raise located(exc, call.script) from exc
        return call.parse(reply)
