"""``redis.asyncio`` clients for :class:`~celery_semaphore.asyncio.AsyncSemaphore`.

Two ways to get one: from a URL, in any form :func:`celery_semaphore.core.clients.
client_from_url` takes (:func:`async_client_from_url`); or as the asyncio twin of a redis-py
client that already points at the right server (:func:`async_client_like`), which is how
``@bounded`` on a coroutine function reaches the Redis that a Celery app's tasks use,
whichever setting named it.

Either way the client gets the semaphore's timeouts and connection retries (see
:func:`~celery_semaphore.core.clients.default_options`): a renewal that cannot get through
must surface within seconds.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeAlias

import redis
from redis import asyncio as aioredis
from redis.asyncio import connection as aioconnection
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.sentinel import SentinelConnectionPool

from ..core.clients import (
    CLUSTER_SCHEME,
    SENTINEL_SCHEME,
    TIMEOUTS,
    _normalise_query,
    default_options,
    split_url,
)
from ..errors import SemaphoreValidationError

AsyncClient: TypeAlias = aioredis.Redis | aioredis.RedisCluster
"""The clients an :class:`AsyncSemaphore` works with: a plain (or Sentinel-managed) one, or
a Redis Cluster one."""

_TWINS: dict[type[Any], type[aioconnection.AbstractConnection]] = {
    redis.connection.Connection: aioconnection.Connection,
    redis.connection.SSLConnection: aioconnection.SSLConnection,
    redis.connection.UnixDomainSocketConnection: aioconnection.UnixDomainSocketConnection,
}
"""The asyncio connection class that speaks to the same server as each redis-py one."""


def async_client_from_url(url: str, **kwargs: Any) -> AsyncClient:
    """A ``redis.asyncio`` client for ``url``, with the settings a semaphore needs.

    Args:
        url (str): ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` or
            ``redis+sentinel://``, as :func:`celery_semaphore.core.clients.client_from_url`
            describes them.
        **kwargs: client options, over the semaphore's defaults (5 s socket and connect
            timeouts, two retries of a failed connection).

    Returns:
        redis.asyncio.Redis | redis.asyncio.RedisCluster: a new client; it connects on
        first use.

    Raises:
        SemaphoreValidationError: the URL is malformed, or of no form above.
    """
    options = {**default_options(Retry), **kwargs}
    if url.startswith(CLUSTER_SCHEME):
        nodes, _, parsed = split_url(url)
        return _cluster(nodes, {**options, **parsed})
    if url.startswith(SENTINEL_SCHEME):
        nodes, service, parsed = split_url(url)
        return _sentinel(nodes, service, {**options, **parsed})
    try:
        return aioredis.Redis.from_url(_normalise_query(url), **options)
    except ValueError as exc:  # redis-py's word for a URL it cannot parse
        raise SemaphoreValidationError(f"cannot use Redis URL {url!r}: {exc}") from None


def async_client_like(client: redis.Redis | redis.RedisCluster) -> AsyncClient:
    """A ``redis.asyncio`` client for the server(s) that the redis-py ``client`` talks to:
    same address, database, credentials and TLS options, the semaphore's retry.

    Args:
        client (redis.Redis | redis.RedisCluster): a plain, TLS, Unix-socket,
            Sentinel-managed or cluster client.

    Returns:
        redis.asyncio.Redis | redis.asyncio.RedisCluster: a new client; it connects on
        first use.

    Raises:
        SemaphoreValidationError: the client's connections are of a kind with no asyncio
            twin (a custom connection class).
    """
    if isinstance(client, redis.RedisCluster):
        known = client.get_nodes()  # type: ignore[no-untyped-call,unused-ignore]
        nodes = [(node.host, int(node.port)) for node in known]
        first = known[0].redis_connection
        kwargs = first.connection_pool.connection_kwargs if first is not None else {}
        return _cluster(nodes, _accepted(aioredis.RedisCluster, kwargs))
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        sentinels = [
            (
                s.connection_pool.connection_kwargs["host"],
                s.connection_pool.connection_kwargs["port"],
            )
            for s in pool.sentinel_manager.sentinels
        ]
        options = _accepted(aioconnection.Connection, pool.connection_kwargs)
        return _sentinel(sentinels, pool.service_name, options)
    twin = _TWINS.get(pool.connection_class)
    if twin is None:
        raise SemaphoreValidationError(
            f"no asyncio twin for Redis connections of {pool.connection_class.__name__}: "
            "pass an asyncio client (redis.asyncio.Redis) or a URL instead"
        )
    options = _accepted(twin, pool.connection_kwargs)
    return aioredis.Redis(connection_pool=aioredis.ConnectionPool(connection_class=twin, **options))


def _accepted(cls: type[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` that ``cls`` (a connection or client class) takes (a parameter of its own
    ``__init__`` or of a base's), sync-only options dropped, with the semaphore's asyncio
    retry in place of the sync one."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names.update(inspect.signature(init).parameters)
    names -= {"self", "args", "kwargs", "retry"}
    options = {k: v for k, v in kwargs.items() if k in names}
    return {**options, "retry": default_options(Retry)["retry"]}


def _cluster(nodes: list[tuple[str, int]], options: dict[str, Any]) -> aioredis.RedisCluster:
    startup = [ClusterNode(host, port) for host, port in nodes]
    # Cluster clients retry per command (and resend after a timeout) on their own terms:
    # give them the timeouts and credentials only.
    options = {k: v for k, v in options.items() if k != "retry"}
    return aioredis.RedisCluster(startup_nodes=startup, **options)


def _sentinel(nodes: list[tuple[str, int]], service: str, options: dict[str, Any]) -> AsyncClient:
    sentinel_kwargs = options.pop(
        "sentinel_kwargs", {name: options[name] for name in TIMEOUTS if name in options}
    )
    sentinel = Sentinel(nodes, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call,unused-ignore]
    client: aioredis.Redis = sentinel.master_for(service, **options)
    return client


def async_client_of(redis: object) -> AsyncClient:
    """The ``redis.asyncio`` client an :class:`AsyncSemaphore` is given: ``redis`` itself, or
    one made from a URL (see :func:`async_client_from_url`).

    Raises:
        SemaphoreValidationError: it is neither such a client nor a URL.
    """
    if isinstance(redis, str):
        return async_client_from_url(redis)
    if isinstance(redis, (aioredis.Redis, aioredis.RedisCluster)) and not hasattr(redis, "execute"):
        return redis  # a pipeline is a Redis subclass, but cannot run our calls
    raise SemaphoreValidationError(
        "redis must be a redis.asyncio.Redis or redis.asyncio.RedisCluster client or a "
        f"URL, got {type(redis).__name__}"
    )
