"""Redis Cluster and Sentinel set-ups for the project's own high-availability tests.

:class:`ClusterServers` forms three primaries with ``redis-cli --cluster create``;
:class:`SentinelServers` runs a primary, a replica and one Sentinel, with a forced failover on
demand. Both are built from :class:`celery_semaphore.testing.RedisServer` processes.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode
from redis.retry import Retry
from redis.sentinel import Sentinel

from celery_semaphore.testing import RedisServer, _free_port, find_redis_cli, find_redis_server

_CLUSTER_BUS_OFFSET = 10_000


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


_M = TypeVar("_M", bound="_Managed")


class _Managed:
    """``with`` support for the set-ups below: ``start()`` on entry, ``close()`` on exit."""

    def start(self: _M) -> _M:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _M) -> _M:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (port + 10000) is free too, clashing with neither
    ``taken`` nor their bus ports."""
    for _ in range(200):
        port = _free_port()
        bus = port + _CLUSTER_BUS_OFFSET
        clash = {port, bus} & (taken | {p + _CLUSTER_BUS_OFFSET for p in taken})
        if bus <= 65535 and not clash and _port_is_free(bus):
            return port
    raise RuntimeError("found no free port pair for a cluster node")


def _start_node(node: RedisServer, others: set[int], tries: int = 5) -> RedisServer:
    """Start cluster ``node``; if it exits at once (another process took its port or its bus
    port after they were picked: tests run in parallel), start one like it on a new pair.

    Raises:
        RuntimeError: no pair worked in ``tries``.
    """
    for _ in range(tries - 1):
        try:
            return node.start()
        except RuntimeError:
            node.close()
            node = RedisServer(_free_cluster_port(others), node.binary, node.extra_args,
                               node.startup_timeout)  # fmt: skip
    return node.start()


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 20 ms until it is true; Redis errors count as false.

    Raises:
        RuntimeError: still false after ``timeout`` seconds; the message names ``what``.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def _info_fields(reply: Any) -> dict[str, str]:
    """A ``CLUSTER INFO`` reply as a dict of str, whether redis-py parsed it or not."""
    if isinstance(reply, dict):
        return {_text(name): _text(value) for name, value in reply.items()}
    pairs = (line.partition(":") for line in _text(reply).splitlines() if ":" in line)
    return {name.strip(): value.strip() for name, _, value in pairs}


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class ClusterServers(_Managed):
    """A Redis Cluster of three primaries (no replicas) on 127.0.0.1 that this object owns.

    Each node is a :class:`RedisServer` started with ``--cluster-enabled yes`` and persistence
    off, on a free port whose cluster bus port (port + 10000) is free too. The cluster is formed
    by ``redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes``, which splits the
    16384 hash slots evenly between the nodes; :meth:`start` returns once every node reports
    ``cluster_state:ok`` with all slots served.

    Args:
        primaries (int): how many primary nodes; at least 3, which ``redis-cli`` requires.
        binary (str | None): path of ``redis-server``; None uses :func:`find_redis_server`.
        cli (str | None): path of ``redis-cli``; None uses :func:`find_redis_cli` (the one
            beside ``binary`` first).
        node_timeout (float): the nodes' ``cluster-node-timeout``, seconds.
        startup_timeout (float): seconds each node may take to answer PING, and again the
            cluster to form and report ``cluster_state:ok``.

    Raises:
        ValueError: fewer than 3 primaries.
        FileNotFoundError: no ``redis-server`` or ``redis-cli`` was found.

    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        primaries: int = 3,
        binary: str | None = None,
        cli: str | None = None,
        node_timeout: float = 5.0,
        startup_timeout: float = 30.0,
    ) -> None:
        if primaries < 3:
            raise ValueError(f"a cluster needs at least 3 primaries, got {primaries}")
        self.binary = binary or find_redis_server()
        self.cli = cli or find_redis_cli(self.binary)
        self.node_timeout = node_timeout
        self.startup_timeout = startup_timeout
        args = ("--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(round(node_timeout * 1000)))  # fmt: skip
        ports: set[int] = set()
        self.nodes: list[RedisServer] = []
        for _ in range(primaries):
            port = _free_cluster_port(ports)
            ports.add(port)
            self.nodes.append(RedisServer(port, self.binary, args, startup_timeout))

    @property
    def addresses(self) -> list[str]:
        """``127.0.0.1:<port>`` of every node."""
        return [f"127.0.0.1:{node.port}" for node in self.nodes]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:<port>,127.0.0.1:<port>,...`` (every node)."""
        return "redis+cluster://" + ",".join(self.addresses)

    def client(self, **kwargs: Any) -> redis.RedisCluster:
        """A new cluster client with every node as a startup node: 5 s socket timeouts and no
        retries (a test that breaks a node wants the error at once); ``kwargs`` override."""
        options: dict[str, Any] = {
            "socket_timeout": 5.0,
            "socket_connect_timeout": 5.0,
            "retry": Retry(NoBackoff(), 0),
        }
        options.update(kwargs)
        nodes = [ClusterNode("127.0.0.1", node.port) for node in self.nodes]  # type: ignore[no-untyped-call]
        return redis.RedisCluster(startup_nodes=nodes, **options)

    def start(self) -> ClusterServers:
        """Start the nodes, form the cluster and wait until it serves every slot.

        Raises:
            RuntimeError: a node did not start, ``redis-cli --cluster create`` failed (the
                message quotes its output), or the cluster was not ok within
                ``startup_timeout`` seconds. Every process started is stopped first.
        """
        try:
            for i, node in enumerate(self.nodes):
                self.nodes[i] = _start_node(node, {n.port for n in self.nodes if n is not node})
            command = [self.cli, "--cluster", "create", *self.addresses,
                       "--cluster-replicas", "0", "--cluster-yes"]  # fmt: skip
            try:
                done = subprocess.run(
                    command,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=self.startup_timeout,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"redis-cli --cluster create did not finish in {self.startup_timeout:g}s"
                ) from None
            if done.returncode != 0:
                output = (done.stdout + done.stderr).strip()[-2000:]
                raise RuntimeError(
                    f"redis-cli --cluster create failed with {done.returncode}: {output}"
                )
            _wait(self._is_ok, self.startup_timeout, "cluster_state:ok on every node")
        except BaseException:
            self.close()
            raise
        return self

    def _is_ok(self) -> bool:
        for node in self.nodes:
            client = node.client(socket_timeout=2.0)
            try:
                info = _info_fields(client.cluster("INFO"))
            finally:
                client.close()
            expected = {
                "cluster_state": "ok",
                "cluster_slots_ok": "16384",
                "cluster_known_nodes": str(len(self.nodes)),
            }
            if any(info.get(name) != value for name, value in expected.items()):
                return False
        return True

    def stop(self) -> None:
        """Stop every node (SIGTERM) and wait for each to exit."""
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Stop every node and remove their working directories."""
        for node in self.nodes:
            node.close()


class _SentinelProcess(RedisServer):
    """``redis-server <config> --sentinel``, the config written into its working directory
    (Sentinel rewrites it as its view changes). Its log is ``sentinel.log`` there."""

    def __init__(self, settings: list[str], binary: str, startup_timeout: float) -> None:
        super().__init__(binary=binary, startup_timeout=startup_timeout)
        self.config = os.path.join(self._dir.name, "sentinel.conf")
        self.log = os.path.join(self._dir.name, "sentinel.log")
        self._settings = settings

    def _command(self) -> list[str]:
        if not os.path.exists(self.config):
            lines = [
                f"port {self.port}",
                "bind 127.0.0.1",
                "daemonize no",
                f"dir {self._dir.name}",
                f"logfile {self.log}",
                *self._settings,
            ]
            with open(self.config, "w", encoding="utf-8") as file:
                file.write("\n".join(lines) + "\n")
        return [self.binary, self.config, "--sentinel"]

    def log_tail(self, chars: int = 2000) -> str:
        """The end of Sentinel's log, for error messages."""
        try:
            with open(self.log, encoding="utf-8", errors="replace") as file:
                return file.read()[-chars:]
        except OSError:
            return ""


class SentinelServers(_Managed):
    """A primary, one replica and one Sentinel watching them, on 127.0.0.1, owned by this object.

    The replica is started with ``--replicaof`` the primary; the Sentinel monitors the primary
    as ``service_name`` with quorum 1, so :meth:`failover` (``SENTINEL FAILOVER``) promotes the
    replica without asking anyone. Persistence is off everywhere.

    Args:
        service_name (str): the name the Sentinel monitors the primary under.
        binary (str | None): path of ``redis-server``; None uses :func:`find_redis_server`.
        down_after (float): ``down-after-milliseconds``, in seconds: how long the primary may
            stay silent before the Sentinel deems it down and fails over by itself. Short, but
            long enough that a busy test machine does not trigger failovers of its own.
        failover_timeout (float): the Sentinel's ``failover-timeout``, seconds.
        startup_timeout (float): seconds each process may take to answer PING, and again the
            replica to sync and the Sentinel to see it.

    Attributes:
        nodes (tuple[RedisServer, RedisServer]): the two data nodes, the first one the
            primary at start; which one is primary changes with each failover (see
            :meth:`primary`).
        sentinel (RedisServer): the Sentinel process.

    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(
        self,
        service_name: str = "mymaster",
        binary: str | None = None,
        down_after: float = 5.0,
        failover_timeout: float = 10.0,
        startup_timeout: float = 30.0,
    ) -> None:
        self.service_name = service_name
        self.binary = binary or find_redis_server()
        self.startup_timeout = startup_timeout
        # Redis 7 syncs replicas diskless after a 5 s wait for more replicas; none will come.
        sync = ("--repl-diskless-sync-delay", "0")
        first = RedisServer(binary=self.binary, extra_args=sync, startup_timeout=startup_timeout)
        second = RedisServer(
            binary=self.binary,
            extra_args=(*sync, "--replicaof", "127.0.0.1", str(first.port)),
            startup_timeout=startup_timeout,
        )
        self.nodes = (first, second)
        name = service_name
        settings = [
            f"sentinel monitor {name} 127.0.0.1 {first.port} 1",
            f"sentinel down-after-milliseconds {name} {round(down_after * 1000)}",
            f"sentinel failover-timeout {name} {round(failover_timeout * 1000)}",
            f"sentinel parallel-syncs {name} 1",
        ]
        self.sentinel: _SentinelProcess = _SentinelProcess(settings, self.binary, startup_timeout)

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:<sentinel port>/<service_name>``."""
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.service_name}"

    def sentinel_client(self, **kwargs: Any) -> Sentinel:
        """A new :class:`redis.sentinel.Sentinel` for this Sentinel: 5 s socket timeouts
        towards the Sentinel and the data nodes; ``kwargs`` go to the data-node connections."""
        timeouts = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        options: dict[str, Any] = {**timeouts, **kwargs}
        address = ("127.0.0.1", self.sentinel.port)
        return Sentinel([address], sentinel_kwargs=timeouts, **options)  # type: ignore[no-untyped-call]

    def master_client(self, **kwargs: Any) -> redis.Redis:
        """A client for whichever node the Sentinel names primary, via
        ``Sentinel(...).master_for(service_name)``: it follows failovers.

        5 s socket timeouts, and a failed connection (the old primary refusing writes after
        a failover counts as one) is retried twice with a short backoff; ``kwargs`` override.
        """
        retry = Retry(
            ExponentialBackoff(cap=0.5, base=0.05), 2, supported_errors=(redis.ConnectionError,)
        )
        options: dict[str, Any] = {"retry": retry, **kwargs}
        sentinel = self.sentinel_client()
        client: redis.Redis = sentinel.master_for(self.service_name, **options)  # type: ignore[no-untyped-call]
        return client

    def primary_port(self) -> int:
        """The port of the node the Sentinel names primary now (one round trip)."""
        client = self.sentinel.client(socket_timeout=2.0)
        try:
            address = client.sentinel_get_master_addr_by_name(self.service_name)
        finally:
            client.close()
        if not isinstance(address, (tuple, list)):
            raise RuntimeError(f"the Sentinel knows no primary {self.service_name!r}")
        return int(address[1])

    def primary(self) -> RedisServer:
        """The node the Sentinel names primary now."""
        port = self.primary_port()
        return next(node for node in self.nodes if node.port == port)

    def replica(self) -> RedisServer:
        """The node the Sentinel does not name primary."""
        port = self.primary_port()
        return next(node for node in self.nodes if node.port != port)

    def start(self) -> SentinelServers:
        """Start primary, replica and Sentinel; return once the replica is in sync and the
        Sentinel could promote it.

        Raises:
            RuntimeError: a process did not start, or the set was not ready within
                ``startup_timeout`` seconds. Every process started is stopped first.
        """
        try:
            for node in (*self.nodes, self.sentinel):
                node.start()
            self._wait_replica_ready(self.nodes[1], self.startup_timeout)
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _role(node: RedisServer) -> dict[str, Any]:
        """``INFO replication`` of ``node``, parsed."""
        client = node.client(socket_timeout=2.0)
        try:
            return client.info("replication")
        finally:
            client.close()

    def _can_promote(self, replica: RedisServer) -> bool:
        if self._role(replica).get("master_link_status") != "up":
            return False
        client = self.sentinel.client(socket_timeout=2.0, decode_responses=True)
        try:
            rows = client.sentinel_slaves(self.service_name)
        finally:
            client.close()
        return any(
            row.get("port") == replica.port
            and row.get("flags") == "slave"
            and row.get("master-link-status") == "ok"
            for row in rows
        )

    def _wait_replica_ready(self, replica: RedisServer, timeout: float) -> None:
        try:
            _wait(
                lambda: self._can_promote(replica),
                timeout,
                f"replica {replica.port} in sync and known to the Sentinel",
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; Sentinel log: {self.sentinel.log_tail()}") from None

    def failover(self, timeout: float = 30.0) -> RedisServer:
        """Promote the replica with ``SENTINEL FAILOVER`` and wait until it is primary.

        Returns once the Sentinel names the former replica primary and it says so itself,
        the former primary has been made its replica and is in sync, and the Sentinel could
        fail over again. The Sentinel would demote the former primary by itself, but only
        some seconds after it next polls it; this does it at once (``REPLICAOF``), so clients
        holding connections to the old primary get ``READONLY`` errors and move over.
        Writes the old primary accepted after the promotion are lost, as in any failover.

        Args:
            timeout (float): seconds allowed for each step.

        Returns:
            RedisServer: the new primary.

        Raises:
            RuntimeError: a step did not happen within ``timeout`` seconds; the message
                names it and quotes the end of the Sentinel's log.
        """
        old = self.primary()
        new = next(node for node in self.nodes if node is not old)
        self._wait_replica_ready(new, timeout)
        sentinel = self.sentinel.client(socket_timeout=2.0, decode_responses=True)
        try:
            self._failover(sentinel, old, new, timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; Sentinel log: {self.sentinel.log_tail()}") from None
        finally:
            sentinel.close()
        self._wait_replica_ready(old, timeout)
        return new

    def _failover(
        self, sentinel: redis.Redis, old: RedisServer, new: RedisServer, timeout: float
    ) -> None:
        try:
            sentinel.sentinel_failover(self.service_name)
        except redis.ResponseError as exc:
            raise RuntimeError(f"SENTINEL FAILOVER {self.service_name} refused: {exc}") from None

        def promoted() -> bool:
            if self.primary_port() != new.port or self._role(new).get("role") != "master":
                return False
            state = sentinel.sentinel_master(self.service_name)
            return isinstance(state, dict) and "failover_in_progress" not in state["flags"]

        def demoted() -> bool:
            role = self._role(old)
            return role.get("role") == "slave" and role.get("master_link_status") == "up"

        _wait(promoted, timeout, f"the Sentinel to promote {new.port}")
        client = old.client()
        try:
            if self._role(old).get("role") == "master":
                # What the Sentinel sends a primary it demotes: its clients are disconnected,
                # so that they ask a Sentinel again where the primary is.
                pipe = client.pipeline(transaction=True)
                pipe.replicaof("127.0.0.1", str(new.port))
                pipe.client_kill_filter(_type="normal", skipme=True)
                pipe.execute()
        finally:
            client.close()
        _wait(demoted, timeout, f"{old.port} to sync as a replica of {new.port}")

    def close(self) -> None:
        """Stop the Sentinel and both nodes and remove their working directories."""
        for process in (self.sentinel, *self.nodes):
            process.close()


def ha_capable() -> str:
    """Why the Redis binaries here cannot run these set-ups, or "" when they can."""
    try:
        server = find_redis_server()
        find_redis_cli(server)
    except FileNotFoundError as exc:
        return str(exc)
    out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=30)
    found = re.search(r"v=(\d+)\.", out.stdout)
    if found is None:
        return f"cannot tell the version of {server}: {out.stdout.strip()!r}"
    if int(found.group(1)) < 5:
        return f"{server} is Redis {found.group(1)}: cluster create and --replicaof need 5.0+"
    return ""
