"""Private RabbitMQ nodes for tests: a 3-node cluster on loopback, or one TLS node.

The machine's own RabbitMQ (``rabbit@<host>`` on 5672, what every other test shares)
is never touched: each private node has its own node name (``rabbit-<n>-<token>``, so
concurrent test runs cannot collide in epmd), free loopback ports for AMQP and Erlang
distribution, and its data, logs, configuration, enabled-plugins file and Erlang
cookie under a directory the test owns. The cookie is a file in a private ``HOME``
shared by the nodes and by the ``rabbitmqctl`` calls that manage them (the
``RABBITMQ_ERLANG_COOKIE`` variable is deprecated). ``RABBITMQ_CONF_ENV_FILE`` points
at an empty file, so the machine's ``/etc/rabbitmq/rabbitmq-env.conf`` (which names
the system node) is not read either.

The server is started from ``/usr/lib/rabbitmq/bin`` (Debian's ``/usr/sbin`` wrappers
``su`` to the ``rabbitmq`` user and drop the environment), as a process group of its
own: ``kill9`` is a node crash. ``close`` kills every node and removes the directory,
whatever happened (and the ``atexit`` hook of ``tests/support/procs.py`` kills nodes a
crashed test left). The nodes register with the machine's epmd (port 4369) under
their own names; where none runs, the first node starts one, which outlives the test
as epmd always does. Joining is the operator's procedure (``stop_app``,
``join_cluster``, ``start_app``); ``deploy/rabbitmq/README.md`` describes it, and its
node files' "cluster" section is part of every private node's configuration
(``example_cluster_settings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.etcd import free_port
from tests.support.procs import ChildProcess
from tests.support.tls import Pki

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "rabbitmq" / "rabbitmq-1.conf"
SBIN = Path(os.environ.get("DUETIME_TEST_RABBITMQ_SBIN", "/usr/lib/rabbitmq/bin"))
CTL_TIMEOUT = 60.0  # one rabbitmqctl call (an Erlang VM boot) on a busy 2-core box
BOOT_TIMEOUT = 90.0


def example_cluster_settings() -> dict[str, str]:
    """The "cluster" section of deploy/rabbitmq's node files, which every private node
    runs with (so a key RabbitMQ rejects fails the test), less what cannot apply on
    loopback: peer discovery (the test joins with rabbitmqctl) and the free-disk limit
    sized for a production disk."""
    lines = EXAMPLE.read_text().split("## -- the cluster", 1)[1].splitlines()[1:]
    out: dict[str, str] = {}
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, value = (part.strip() for part in line.partition("="))
        if not key.startswith(("cluster_formation.", "disk_free_limit.")):
            out[key] = value
    return out


def missing() -> str | None:
    """Why private nodes cannot run here (None: they can)."""
    for tool in ("rabbitmq-server", "rabbitmqctl"):
        if not os.access(SBIN / tool, os.X_OK):
            return f"{SBIN / tool} not found (Debian package rabbitmq-server)"
    return None


@dataclass
class RabbitNode:
    """One private node; ``url()`` is how duetime reaches it."""

    number: int
    name: str  # Erlang node name, rabbit-<n>-<token>@localhost
    port: int  # AMQP (amqps when ``tls_port`` is set, plain stays on ``port``)
    dist_port: int
    directory: Path
    env: dict[str, str]
    tls_port: int | None = None
    proc: ChildProcess | None = None
    killed: bool = False

    def url(self, vhost: str = "", **query: str) -> str:
        suffix = "?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else ""
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{vhost}{suffix}"

    def tls_url(self, vhost: str = "", **query: str) -> str:
        """``amqps://`` on the TLS listener (``localhost``, the name the certificate has)."""
        if self.tls_port is None:
            raise ValueError(f"{self.name} has no TLS listener")
        suffix = "?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else ""
        return f"amqps://guest:guest@localhost:{self.tls_port}/{vhost}{suffix}"

    @property
    def log_file(self) -> Path:
        return self.directory / "log" / f"{self.name}.log"

    def running(self) -> bool:
        return self.proc is not None and self.proc.running()

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_file.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = []
        startup = self.proc.tail(lines) if self.proc is not None else ""
        return f"--- {self.name} (log {self.log_file})\n" + "\n".join(text) + f"\n{startup}"


@dataclass
class RabbitCluster:
    """``size`` private nodes clustered together (``size=1``: a lone node).

    With ``pki``, every node also has a TLS listener that requires a client
    certificate signed by ``pki.ca`` (``ssl_options.fail_if_no_peer_cert``).
    """

    size: int = 3
    pki: Pki | None = None
    base_dir: Path | None = None
    nodes: list[RabbitNode] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._own_dir = self.base_dir is None
        self.directory = Path(self.base_dir or tempfile.mkdtemp(prefix="duetime-rabbit-"))
        self.token = uuid.uuid4().hex[:6]
        home = self.directory / "home"
        home.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        cookie.write_text(uuid.uuid4().hex.upper())
        os.chmod(cookie, 0o400)  # Erlang refuses a cookie others can read
        env_file = self.directory / "rabbitmq-env.conf"
        env_file.write_text("")
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RABBITMQ_", "ERL_")) and k != "HOME"
        }
        base.update(HOME=str(home), RABBITMQ_CONF_ENV_FILE=str(env_file))
        base["ERL_EPMD_ADDRESS"] = "127.0.0.1"  # an epmd started by us listens on loopback
        for number in range(1, self.size + 1):
            directory = self.directory / f"n{number}"
            directory.mkdir(exist_ok=True)
            name = f"rabbit-{number}-{self.token}@localhost"
            node = RabbitNode(
                number=number,
                name=name,
                port=free_port(),
                dist_port=free_port(),
                tls_port=free_port() if self.pki is not None else None,
                directory=directory,
                env={},
            )
            (directory / "enabled_plugins").write_text("[].\n")
            (directory / "rabbitmq.conf").write_text(self._config(node))
            node.env = {
                **base,
                "RABBITMQ_NODENAME": name,
                "RABBITMQ_NODE_PORT": str(node.port),
                "RABBITMQ_DIST_PORT": str(node.dist_port),
                "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
                "RABBITMQ_LOG_BASE": str(directory / "log"),
                "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq.conf"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(directory / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
                "RABBITMQ_PID_FILE": str(directory / "rabbit.pid"),
                # distribution on loopback only, like the AMQP listener
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": (
                    "-kernel inet_dist_use_interface {127,0,0,1}"
                ),
            }
            self.nodes.append(node)

    def _config(self, node: RabbitNode) -> str:
        lines = [
            f"listeners.tcp.1 = 127.0.0.1:{node.port}",
            "log.console = false",
            # a full disk on a shared CI box must not block publishers mid-test
            "disk_free_limit.absolute = 10MB",
        ]
        lines += [f"{key} = {value}" for key, value in example_cluster_settings().items()]
        if self.pki is not None:
            lines += [
                f"listeners.ssl.1 = 127.0.0.1:{node.tls_port}",
                f"ssl_options.cacertfile = {self.pki.ca}",
                f"ssl_options.certfile = {self.pki.server_cert}",
                f"ssl_options.keyfile = {self.pki.server_key}",
                "ssl_options.verify = verify_peer",
                "ssl_options.fail_if_no_peer_cert = true",
            ]
        return "\n".join(lines) + "\n"

    # -- commands --------------------------------------------------------------------

    async def ctl(self, node: RabbitNode, *args: str, tool: str = "rabbitmqctl") -> str:
        """Run ``rabbitmqctl -n <node> args`` (or another CLI tool); its stdout, or
        RuntimeError with its output."""
        argv = [str(SBIN / tool), "-n", node.name, *args]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=node.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), CTL_TIMEOUT)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(
                f"{tool} {' '.join(args)} on {node.name} exited {proc.returncode}:\n"
                f"{out.decode(errors='replace')}{err.decode(errors='replace')}"
            )
        return out.decode(errors="replace")

    async def ctl_json(self, node: RabbitNode, *args: str) -> Any:
        return json.loads(await self.ctl(node, *args, "--formatter", "json", "--quiet"))

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> RabbitCluster:
        """Boot every node at once, wait until each serves AMQP, then join nodes 2..n
        to node 1 and wait until all of them are running members."""
        started = time.monotonic()
        for node in self.nodes:
            node.proc = ChildProcess(
                [str(SBIN / "rabbitmq-server")],
                name=node.name.split("@")[0],
                env=node.env,
                inherit_env=False,
                log_dir=node.directory,
            ).start()
        await asyncio.gather(*(self._await_boot(node) for node in self.nodes))
        self.timings["boot_s"] = round(time.monotonic() - started, 1)
        joined = time.monotonic()
        first, others = self.nodes[0], self.nodes[1:]
        if others:
            await asyncio.gather(*(self.ctl(node, "stop_app") for node in others))
            for node in others:  # one at a time: each join changes the cluster's schema
                await self.ctl(node, "join_cluster", first.name)
            await asyncio.gather(*(self.ctl(node, "start_app") for node in others))
            await asyncio.gather(*(self._await_app(node) for node in others))
            members = await self.running_members(first)
            expected = {n.name for n in self.nodes}
            if members != expected:
                raise RuntimeError(f"cluster has running nodes {members}, expected {expected}")
        self.timings["join_s"] = round(time.monotonic() - joined, 1)
        return self

    async def _await_boot(self, node: RabbitNode) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT
        while not await _port_open(node.port):
            assert node.proc is not None
            if not node.proc.running():
                raise RuntimeError(
                    f"{node.name} exited with {node.proc.returncode} during boot\n{node.tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{node.name} not serving after {BOOT_TIMEOUT:.0f}s\n{node.tail()}"
                )
            await asyncio.sleep(0.2)
        # the listener opens a moment before the boot completes
        await self.ctl(node, "await_startup", "--timeout", str(int(BOOT_TIMEOUT)))

    async def _await_app(self, node: RabbitNode) -> None:
        await self.ctl(node, "await_startup", "--timeout", str(int(BOOT_TIMEOUT)))
        deadline = time.monotonic() + BOOT_TIMEOUT
        while not await _port_open(node.port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node.name} not serving after start_app\n{node.tail()}")
            await asyncio.sleep(0.2)

    async def running_members(self, via: RabbitNode) -> set[str]:
        status = await self.ctl_json(via, "cluster_status")
        return set(status.get("running_nodes", []))

    def kill9(self, node: RabbitNode) -> None:
        """Crash ``node`` (SIGKILL to its process group): no goodbye to its peers."""
        assert node.proc is not None
        node.proc.kill9()
        node.proc.kill()  # reap
        node.killed = True

    def live(self) -> list[RabbitNode]:
        return [n for n in self.nodes if n.running() and not n.killed]

    def node_on_port(self, port: int) -> RabbitNode | None:
        return next((n for n in self.nodes if port in (n.port, n.tls_port)), None)

    # -- what the broker says ----------------------------------------------------------

    async def queue_leader(self, queue: str, vhost: str = "/") -> tuple[str, list[str]]:
        """(leader node, member nodes) of a quorum queue, asked of a live node."""
        rows = await self.ctl_json(
            self.live()[0], "list_queues", "-p", vhost, "name", "type", "leader", "members"
        )
        for row in rows:
            if row["name"] == queue:
                if row.get("type") != "quorum":
                    raise AssertionError(f"{queue} is a {row.get('type')} queue, not quorum")
                return str(row["leader"]), [str(m) for m in row["members"]]
        raise AssertionError(f"no queue {queue} in vhost {vhost}: {[r['name'] for r in rows]}")

    async def connections(self) -> dict[str, RabbitNode | None]:
        """Client-given connection name -> the node it is connected to, across the
        cluster (the server-side port of each connection tells the node)."""
        rows = await self.ctl_json(self.live()[0], "list_connections", "client_properties", "port")
        out: dict[str, RabbitNode | None] = {}
        for row in rows:
            # client_properties: [[key, type, value], ...]
            props = {p[0]: p[2] for p in row["client_properties"] if len(p) == 3}
            out[str(props.get("connection_name", "?"))] = self.node_on_port(int(row["port"]))
        return out

    def describe(self) -> str:
        return "\n".join(node.tail() for node in self.nodes)

    async def close(self) -> None:
        """Kill every node (process group) and remove the directory if it is ours."""
        try:
            for node in self.nodes:
                if node.proc is not None:
                    node.proc.kill()
        finally:
            if self._own_dir:
                shutil.rmtree(self.directory, ignore_errors=True)

    async def __aenter__(self) -> RabbitCluster:
        try:
            return await self.start()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def _port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
