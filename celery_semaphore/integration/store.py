"""Which Redis holds an app's slots, with which client options: read as Celery reads it.

One question, one answer, used by every caller (the tasks, the worker's start-up checks, the
views and the CLI): :func:`resolve_store`. In order:

1. ``semaphore_url``, when set: any URL :func:`~celery_semaphore.core.clients.client_from_url`
   takes.
2. Celery's broker, when it is Redis: the connection Celery itself would open for writing
   (``app.connection_for_write()``), so ``CELERY_BROKER_URL`` and the other environment
   variables, failover lists (the first URL), ``redis+socket://`` and ``sentinel://`` URLs
   (with ``master_name`` from ``broker_transport_options``), ``broker_use_ssl`` and an
   ``ssl_cert_reqs`` in the URL all mean what they mean to Celery.
3. Celery's result backend, when it is Redis: the connection parameters Celery's own Redis
   backend computed (``result_backend``, the ``redis_*`` settings, ``redis_backend_use_ssl``,
   ``rediss://...?ssl_cert_reqs=CERT_NONE``, Sentinel).

Host, port, database, credentials, TLS and Sentinel discovery come from Celery; socket
timeouts and connection retries are the semaphore's own (see
:func:`~celery_semaphore.core.clients.default_options`), because a lost renewal must surface
within seconds, not after the broker's two minutes.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import redis
from celery import Celery

from ..core.clients import (
    CLUSTER_SCHEME,
    SENTINEL_SCHEME,
    client_from_options,
    client_from_url,
    default_options,
    sentinel_client,
)
from ..errors import SemaphoreValidationError

_URL_SCHEMES = ("redis://", "rediss://", "unix://", CLUSTER_SCHEME, SENTINEL_SCHEME)
_KOMBU_REDIS = ("redis", "rediss", "sentinel")
_TRANSPORT_OPTIONS = (
    "socket_keepalive",
    "socket_keepalive_options",
    "health_check_interval",
    "client_name",
)
"""Broker transport options that describe the connection, not kombu's queues, and that the
semaphore's client takes as they are (timeouts excepted: see the module docstring)."""


@dataclass(frozen=True)
class Store:
    """Where an app's slots live.

    Attributes:
        setting (str): the setting it was found in: ``"semaphore_url"``, ``"broker_url"`` or
            ``"result_backend"``.
        url (str): the URL with any password masked, for messages and views.
    """

    setting: str
    url: str
    _connect: Callable[[], redis.Redis] = field(repr=False, compare=False)

    def connect(self) -> redis.Redis:
        """A new redis-py client for this store (connections open on first use).

        Raises:
            SemaphoreValidationError: the options cannot make a connection (a bad TLS flag).
            SemaphoreBackendError: a ``redis+cluster://`` store could not be reached.
        """
        try:
            return self._connect()
        except SemaphoreValidationError as exc:
            raise SemaphoreValidationError(f"{self.setting} ({self.url}): {exc}") from None


def resolve_store(app: Celery) -> Store:
    """Which Redis holds ``app``'s slots (see the module docstring for the order).

    Raises:
        SemaphoreValidationError: ``semaphore_url`` is not a Redis URL, neither the broker nor
            the result backend is Redis, or Celery's own settings for the one chosen are
            invalid; the message names the setting.
    """
    conf = app.conf
    explicit = conf.get("semaphore_url")
    if explicit:
        if not isinstance(explicit, str) or not explicit.startswith(_URL_SCHEMES):
            raise SemaphoreValidationError(
                f"semaphore_url must be a Redis URL ({', '.join(_URL_SCHEMES)}), "
                f"got {explicit!r:.80}"
            )
        return Store("semaphore_url", _masked(explicit), lambda: client_from_url(explicit))
    found = _from_broker(app) or _from_backend(app)
    if found is None:
        raise SemaphoreValidationError(
            "semaphore_url is not set and neither the broker "
            f"({_masked(str(conf.broker_url))}) nor the result backend "
            f"({_masked(str(conf.result_backend))}) is Redis: set "
            "app.conf.semaphore_url = 'redis://host:6379/0'"
        )
    return found


def broker_visibility_timeout(app: Celery) -> float | None:
    """Seconds after which the Redis broker delivers an unacknowledged message again, as
    kombu's Redis transport reads it; None when the broker is not Redis (or the app's broker
    settings cannot be read, which Celery reports itself)."""
    connection = _broker_connection(app)
    if connection is None:
        return None
    return float(connection.transport_options.get("visibility_timeout", 3600))


def _broker_connection(app: Celery) -> Any:
    """Celery's own connection object for its broker (not connected), if that is Redis."""
    try:
        connection = app.connection_for_write()
    except (KeyError, ValueError, ImportError):  # an unknown transport: Celery will say
        return None
    transport = connection.transport_cls
    return connection if isinstance(transport, str) and transport in _KOMBU_REDIS else None


def _from_broker(app: Celery) -> Store | None:
    connection = _broker_connection(app)
    if connection is None:
        return None
    transport_options: Mapping[str, Any] = connection.transport_options or {}
    options: dict[str, Any] = {
        name: transport_options[name] for name in _TRANSPORT_OPTIONS if name in transport_options
    }
    if connection.userid:
        options["username"] = connection.userid
    if connection.password:
        options["password"] = connection.password
    if isinstance(connection.ssl, Mapping) and connection.ssl:
        options.update(connection.ssl, ssl=True)
    db = _db(connection.virtual_host)
    url = _masked(connection.as_uri(include_password=True))

    if connection.transport_cls == "sentinel":
        service = transport_options.get("master_name")
        if not service:
            raise SemaphoreValidationError(
                "broker_url is a sentinel:// URL but broker_transport_options has no "
                "'master_name': Celery needs it too"
            )
        nodes = [_host_port(alt, 26379) for alt in connection.alt] or [
            (connection.hostname, connection.port or 26379)
        ]
        if "sentinel_kwargs" in transport_options:
            options["sentinel_kwargs"] = transport_options["sentinel_kwargs"]
        return Store(
            "broker_url",
            url,
            lambda: sentinel_client(nodes, service, db=db, **options),
        )

    host = str(connection.hostname or "127.0.0.1")
    if host.startswith("socket://"):  # kombu's redis+socket:///path?virtual_host=N
        parts = urlsplit(host)
        query = dict(parse_qsl(parts.query))
        options.update(unix_socket_path=parts.path, db=_db(query.get("virtual_host", db)))
    else:
        options.update(host=host, port=connection.port or 6379, db=db)
    return Store(
        "broker_url", url, lambda: client_from_options(redis.Redis, **default_options(), **options)
    )


def _from_backend(app: Celery) -> Store | None:
    # Imported here: the Redis backend module needs redis-py, which is always there for us,
    # but importing it for an app whose backend is not Redis would be wasted work.
    from celery.backends.redis import RedisBackend

    try:
        backend = app.backend
    except (ImportError, ValueError, TypeError) as exc:
        if "redis" not in str(app.conf.result_backend or ""):
            return None
        raise SemaphoreValidationError(f"result_backend: {exc}") from None
    if not isinstance(backend, RedisBackend):
        return None
    params = {**backend.connparams, **default_options()}

    def connect() -> redis.Redis:
        # The backend's own pool factory: a plain pool, or a Sentinel-managed one.
        return client_from_options(lambda: redis.Redis(connection_pool=backend._get_pool(**params)))

    return Store("result_backend", _masked(backend.as_uri(include_password=True)), connect)


def _db(vhost: object) -> int:
    """kombu's reading of a Redis virtual host (``"/3"``, ``"3"``, ``"/"``) as a db number."""
    if isinstance(vhost, numbers.Integral):
        return int(vhost)
    text = str(vhost or "").lstrip("/")
    if text and not text.isdigit():
        raise SemaphoreValidationError(f"broker_url: database must be a number, got {vhost!r}")
    return int(text or 0)


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


def _masked(url: str) -> str:
    """``url`` with its password, if any, shown as ``**`` (multi-host URLs too)."""
    return re.sub(r"://([^/@:]*):[^/@]*@", r"://\1:**@", url)
