"""redis-py clients for the semaphore: from a URL, with the timeouts a semaphore needs.

Besides redis-py's own URL forms this understands ``redis+cluster://`` (a Redis Cluster) and
``redis+sentinel://`` (the primary that Sentinels name), so one ``semaphore_url`` setting can
point at any deployment; see :func:`client_from_url`.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any, TypeAlias, cast
from urllib.parse import parse_qs, parse_qsl, unquote, urlencode, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..errors import SemaphoreBackendError, SemaphoreValidationError

DEFAULT_SOCKET_TIMEOUT = 5.0
CLUSTER_SCHEME = "redis+cluster://"
SENTINEL_SCHEME = "redis+sentinel://"
TIMEOUTS = ("socket_timeout", "socket_connect_timeout")  # a Sentinel's by default

RedisClient: TypeAlias = redis.Redis | redis.RedisCluster
"""The clients a :class:`Semaphore` works with: a plain (or Sentinel-managed) client, or a
Redis Cluster client."""


def split_url(url: str) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    """Parse a cluster or Sentinel URL, for the sync and the asyncio clients alike:
    ``redis+cluster://[[user]:password@]host[:port][,host[:port]...][?query]`` or
    ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db][?query]``.

    Returns:
        tuple: the ``(host, port)`` pairs (port 6379 for a cluster, 26379 for Sentinels,
        unless given), the service name ("" for a cluster), and the client options:
        ``username``/``password`` from the URL, then the query options, parsed as
        :meth:`redis.Redis.from_url` parses them, and a Sentinel URL's ``db``.

    Raises:
        SemaphoreValidationError: no host, a port that is not a number, a cluster URL with a
            database other than 0, or a Sentinel URL with no service name.
    """
    cluster = url.startswith(CLUSTER_SCHEME)
    scheme, default_port = (CLUSTER_SCHEME, 6379) if cluster else (SENTINEL_SCHEME, 26379)
    rest, _, query = url[len(scheme) :].partition("?")
    netloc, _, path = rest.partition("/")
    options: dict[str, Any] = {}
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        username, colon, password = userinfo.partition(":")
        if username:
            options["username"] = unquote(username)
        if colon:
            options["password"] = unquote(password)
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        if item.startswith("["):  # [IPv6 address]:port
            host, _, tail = item[1:].partition("]")
            port_text = tail[1:] if tail.startswith(":") else ""
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise SemaphoreValidationError(f"a host is missing in Redis URL {url!r}")
        if port_text and not port_text.isdigit():
            raise SemaphoreValidationError(f"port {port_text!r} in Redis URL {url!r}")
        nodes.append((unquote(host), int(port_text) if port_text else default_port))
    for name, values in parse_qs(query).items():
        value = unquote(values[0])
        parser: Any = URL_QUERY_ARGUMENT_PARSERS.get(name)
        try:
            options[name] = parser(value) if parser else value
        except (TypeError, ValueError):
            raise SemaphoreValidationError(f"{name}={value!r} in Redis URL {url!r}") from None
    segments = [unquote(part) for part in path.split("/") if part]
    if cluster:
        if segments not in ([], ["0"]) or options.pop("db", 0) != 0:
            raise SemaphoreValidationError(
                f"Redis Cluster has database 0 only; remove the path of {url!r}"
            )
        return nodes, "", options
    if not 1 <= len(segments) <= 2 or (len(segments) == 2 and not segments[1].isdigit()):
        raise SemaphoreValidationError(
            f"a Sentinel URL ends in /<service_name> or /<service_name>/<db>, got {url!r}"
        )
    if len(segments) == 2:
        options["db"] = int(segments[1])
    return nodes, segments[0], options


def sentinel_client(nodes: list[tuple[str, int]], service: str, **options: Any) -> redis.Redis:
    """The primary that the Sentinels at ``nodes`` name for ``service``.

    Args:
        nodes (list[tuple[str, int]]): the Sentinels' ``(host, port)`` pairs.
        service (str): the monitored primary's name (kombu's ``master_name``).
        **options: options for the primary's connections (``db``, ``password``, ``ssl``,
            timeouts, ...), plus ``sentinel_kwargs`` for the Sentinels' own (by default the
            primary's socket timeouts).

    Returns:
        redis.Redis: a client whose every new connection asks a Sentinel for the primary.
    """
    options = {**default_options(), **options}
    sentinel_kwargs = options.pop(
        "sentinel_kwargs", {name: options[name] for name in TIMEOUTS if name in options}
    )
    sentinel = Sentinel(nodes, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call,unused-ignore]
    return client_from_options(sentinel.master_for, service, **options)


def client_of(client: object) -> RedisClient:
    """``client`` if it is a redis-py client that can run our calls, or one made from it if
    it is a URL (see :func:`client_from_url`).

    Raises:
        SemaphoreValidationError: ``client`` is neither (a pipeline is a Redis subclass, but
            cannot run our calls), or a bad URL.
    """
    if isinstance(client, str):
        return client_from_url(client)
    if isinstance(client, (redis.Redis, redis.RedisCluster)) and not hasattr(client, "execute"):
        return client
    raise SemaphoreValidationError(
        "redis must be a redis.Redis or redis.RedisCluster client or a URL, "
        f"got {type(client).__name__}"
    )


def client_from_url(url: str, **kwargs: Any) -> redis.Redis:
    """Make a redis-py client for ``url`` with settings a semaphore needs.

    The URL forms, and the client each makes:

    ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...``, ``unix://...``
        redis-py's own forms: :meth:`redis.Redis.from_url`.
    ``redis+cluster://[[user]:password@]host[:port][,host[:port]...]``
        A :class:`redis.RedisCluster` with every listed node as a startup node (port 6379
        unless given). It learns the slot map from the first node that answers, so one
        reachable node is enough; list several so that any one can be down. A cluster has
        database 0 only, so there is no path.
    ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db]``
        The primary that the Sentinels at the listed addresses (port 26379 unless given)
        name for ``service_name``: ``Sentinel(...).master_for(service_name, db=db)``. Each
        new connection asks a Sentinel where the primary is, so the client follows a
        failover. Credentials in the URL are for the Redis servers; the Sentinels get the
        socket timeouts only (pass ``sentinel_kwargs={...}`` for more, a password say).

    The multi-host forms take the same ``?name=value`` options as redis-py's URLs
    (``socket_timeout=2.5``, ``health_check_interval=30``, ...).

    Unless the URL or ``kwargs`` say otherwise, socket and connect timeouts are
    ``DEFAULT_SOCKET_TIMEOUT`` seconds, and a failed connection is retried twice with a short
    backoff (never a timed-out command, which may already have run), so a dead server
    surfaces as :class:`SemaphoreBackendError` within seconds instead of after redis-py's
    default ten retries. The cluster client is the exception: redis-py retries there are
    per command and resend after a timeout too. It gets 2 such retries (after each it
    re-reads the slot map); every script tolerates being run twice except that a resent
    release answers "already gone", which reports the slot as lost.

    Args:
        url (str): a URL in one of the forms above.
        **kwargs: client options: for :meth:`redis.Redis.from_url`, for
            :class:`redis.RedisCluster`, or for ``master_for`` (plus ``sentinel_kwargs``).

    Returns:
        redis.Redis: a new client with its own connection pool(s). For a
        ``redis+cluster://`` URL it is a :class:`redis.RedisCluster`, which offers the
        commands this package uses but is typed as :class:`redis.Redis` here so that
        callers written for one client type keep type-checking.

    Raises:
        SemaphoreValidationError: the URL is malformed, or of no form above.
        SemaphoreBackendError: no node of a ``redis+cluster://`` URL could be reached (that
            client connects at once; the others on first use).
    """
    options = {**default_options(), **kwargs}
    if url.startswith(CLUSTER_SCHEME):
        nodes, _, parsed = split_url(url)
        startup = [ClusterNode(host, port) for host, port in nodes]  # type: ignore[no-untyped-call,unused-ignore]
        try:
            cluster = redis.RedisCluster(startup_nodes=startup, **{**options, **parsed})
        except (redis.RedisError, RedisClusterException) as exc:
            # Unlike redis.Redis, RedisCluster connects at once to learn the slot map.
            raise SemaphoreBackendError(
                f"cannot reach Redis Cluster at {url!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return cast(redis.Redis, cluster)
    if url.startswith(SENTINEL_SCHEME):
        nodes, service, parsed = split_url(url)
        return sentinel_client(nodes, service, **{**options, **parsed})
    _check_database(url)
    try:
        return client_from_options(redis.Redis.from_url, _normalise_query(url), **options)
    except ValueError as exc:  # redis-py's word for a URL it cannot parse
        if isinstance(exc, SemaphoreValidationError):
            raise
        raise SemaphoreValidationError(f"cannot use Redis URL {url!r}: {exc}") from None


def _check_database(url: str) -> None:
    """Refuse a ``redis://``/``rediss://`` path that names no database: redis-py ignores a
    path that is not a number and uses database 0, so two apps that mistype theirs would
    silently share slots.

    Raises:
        SemaphoreValidationError: the path is neither empty nor a database number.
    """
    parsed = urlsplit(url)
    if parsed.scheme not in ("redis", "rediss"):
        return
    path = parsed.path.strip("/")
    if path and not path.isdigit():
        raise SemaphoreValidationError(
            f"cannot use Redis URL {url!r}: the path must be a database number, got {path!r}"
        )


def default_options(retry: Callable[..., Any] = Retry) -> dict[str, Any]:
    """The client options every semaphore client starts from (see :func:`client_from_url`);
    ``retry`` is the client's ``Retry`` class (``redis.asyncio.retry.Retry`` for an asyncio
    client)."""
    return {
        "socket_timeout": DEFAULT_SOCKET_TIMEOUT,
        "socket_connect_timeout": DEFAULT_SOCKET_TIMEOUT,
        "retry": retry(
            ExponentialBackoff(cap=0.5, base=0.05), 2, supported_errors=(redis.ConnectionError,)
        ),
    }


def client_from_options(
    make: Callable[..., redis.Redis], *args: Any, **options: Any
) -> redis.Redis:
    """``make(*args, **options)`` with ``ssl_cert_reqs`` in any of Celery's spellings, checked.

    Raises:
        SemaphoreValidationError: as :func:`checked`, or ``ssl_cert_reqs`` is no known value.
    """
    if "ssl_cert_reqs" in options:
        options["ssl_cert_reqs"] = _cert_reqs(options["ssl_cert_reqs"])
    return checked(make(*args, **options))


def checked(client: redis.Redis) -> redis.Redis:
    """``client``, once one of its connections could be made (not connected) from its options.

    redis-py checks most connection options only when it opens the first connection, so a bad
    TLS flag would otherwise surface on every command as if the server were down. Making one
    connection object here turns such a mistake into a configuration error, raised once.

    Raises:
        SemaphoreValidationError: the options do not make a connection; the message says why.
    """
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)
    except (TypeError, ValueError, redis.RedisError) as exc:
        raise SemaphoreValidationError(
            f"these Redis client options cannot make a connection: {type(exc).__name__}: {exc}"
        ) from None
    return client


_CERT_REQS = {"none": "none", "optional": "optional", "required": "required"}


def _cert_reqs(value: object) -> object:
    """``ssl_cert_reqs`` as redis-py takes it, from any spelling Celery or kombu accepts
    (``CERT_NONE``, ``none``, ``ssl.CERT_NONE``, ...)."""
    if value is None or isinstance(value, ssl.VerifyMode):
        return value
    if isinstance(value, str):
        name = value.lower().removeprefix("cert_")
        if name in _CERT_REQS:
            return _CERT_REQS[name]
    raise SemaphoreValidationError(
        f"ssl_cert_reqs must be CERT_NONE, CERT_OPTIONAL or CERT_REQUIRED, got {value!r}"
    )


def _normalise_query(url: str) -> str:
    """``url`` with an ``ssl_cert_reqs`` query value in redis-py's spelling."""
    base, sep, query = url.partition("?")
    if not sep or "ssl_cert_reqs" not in query:
        return url
    pairs = parse_qsl(query, keep_blank_values=True)
    fixed = [(k, str(_cert_reqs(v)) if k == "ssl_cert_reqs" else v) for k, v in pairs]
    return f"{base}?{urlencode(fixed)}"
