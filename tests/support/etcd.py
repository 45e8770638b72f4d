"""etcd for tests: the shared server, and private servers tests may break.

Most tests share the etcd that ``make services`` starts (``DUETIME_TEST_ETCD_ENDPOINTS``,
default ``127.0.0.1:2379``) and isolate themselves with a unique key prefix. Tests that
need etcd to *go away* — stopped, killed, restarted on the same data — start a
``PrivateEtcd`` on free loopback ports with its own data directory, so breaking it
cannot disturb anything else running on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from types import TracebackType

from tests.support.procs import ChildProcess

ETCD_BINARY = os.environ.get("DUETIME_TEST_ETCD_BINARY", "/usr/bin/etcd")
SHARED_ENDPOINTS_ENV = "DUETIME_TEST_ETCD_ENDPOINTS"
DEFAULT_SHARED_ENDPOINTS = "127.0.0.1:2379"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def etcd_healthy(endpoint: str, timeout: float = 1.0) -> bool:
    """True when ``GET /health`` on ``host:port`` answers ``"health":"true"`` in time."""
    host, _, port = endpoint.rpartition(":")
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                f"GET /health HTTP/1.1\r\nHost: {endpoint}\r\nConnection: close\r\n\r\n".encode()
            )
            await writer.drain()
            body = await reader.read()
        return b'"health":"true"' in body
    except (OSError, TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def shared_etcd_endpoints() -> list[str]:
    """The shared test etcd endpoints from the environment (comma-separated)."""
    raw = os.environ.get(SHARED_ENDPOINTS_ENV, DEFAULT_SHARED_ENDPOINTS)
    return [e.strip() for e in raw.split(",") if e.strip()]


async def require_shared_etcd(timeout: float = 2.0) -> list[str]:
    """Return the shared endpoints, or fail the test with how to start etcd."""
    import pytest  # imported here so this module also works outside pytest

    endpoints = shared_etcd_endpoints()
    for endpoint in endpoints:
        if await etcd_healthy(endpoint, timeout):
            return endpoints
    pytest.fail(
        f"no healthy etcd at {','.join(endpoints)} ({SHARED_ENDPOINTS_ENV}); "
        "start etcd: make services",
        pytrace=False,
    )


class PrivateEtcd:
    """A single-member etcd of our own on free loopback ports.

    ``stop()``/``kill()`` and a later ``start()`` reuse the same data directory and
    ports, so a test sees an outage followed by the same cluster coming back, with its
    keys and leases (etcd restores leases on restart and extends them by their TTL).

    TLS (optional): with ``cert_file``/``key_file`` clients must speak TLS (``https``
    client URL); with ``trusted_ca_file`` too, ``--client-cert-auth`` makes etcd refuse
    clients without a certificate signed by that CA. Health is then probed on a plain
    HTTP metrics listener (``--listen-metrics-urls``), which needs no client certificate.
    """

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        name: str = "duetime-test",
        start_timeout: float = 20.0,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        trusted_ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        if (cert_file is None) != (key_file is None):
            raise ValueError("cert_file and key_file go together")
        if trusted_ca_file is not None and cert_file is None:
            raise ValueError("client-cert auth (trusted_ca_file) needs cert_file/key_file")
        self.cert_file = cert_file
        self.key_file = key_file
        self.trusted_ca_file = trusted_ca_file
        self.name = name
        self._own_dir = data_dir is None
        self.base_dir = (
            Path(tempfile.mkdtemp(prefix="duetime-etcd-")) if data_dir is None else (Path(data_dir))
        )
        self.data_dir = self.base_dir / "data"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.metrics_port = free_port() if self.tls else None
        self.start_timeout = start_timeout
        self._token = f"duetime-test-{uuid.uuid4().hex[:8]}"
        self._proc: ChildProcess | None = None

    @property
    def tls(self) -> bool:
        return self.cert_file is not None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        """``http(s)://127.0.0.1:<port>`` (what etcdctl's ``--endpoints`` wants)."""
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def health_endpoint(self) -> str:
        """Where ``GET /health`` answers over plain HTTP."""
        if self.metrics_port is not None:
            return f"127.0.0.1:{self.metrics_port}"
        return self.endpoint

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint]

    def running(self) -> bool:
        return self._proc is not None and self._proc.running()

    def _argv(self) -> list[str]:
        client = self.client_url
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls: list[str] = []
        if self.tls:
            tls = [
                "--cert-file", str(self.cert_file),
                "--key-file", str(self.key_file),
                "--listen-metrics-urls", f"http://{self.health_endpoint}",
            ]  # fmt: skip
        if self.trusted_ca_file is not None:
            tls += ["--trusted-ca-file", str(self.trusted_ca_file), "--client-cert-auth"]
        return [
            ETCD_BINARY,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self._token,
            "--log-level", "warn",
            *tls,
        ]  # fmt: skip

    async def start(self) -> PrivateEtcd:
        """Start (or restart on the same data and ports) and wait until healthy."""
        if self.running():
            return self
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        self._proc = ChildProcess(
            self._argv(), name="etcd", env=env, inherit_env=False, log_dir=self.base_dir
        ).start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        while not await etcd_healthy(self.health_endpoint, timeout=0.5):
            if not self._proc.running():
                raise RuntimeError(
                    f"etcd exited with {self._proc.returncode} during start:\n{self._proc.tail()}"
                )
            if loop.time() >= deadline:
                self._proc.kill()
                raise RuntimeError(
                    f"etcd on {self.endpoint} not healthy after {self.start_timeout:.0f}s:\n"
                    f"{self._proc.tail()}"
                )
            await asyncio.sleep(0.05)
        return self

    async def stop(self, timeout: float = 5.0) -> None:
        """Graceful stop: SIGTERM, then SIGKILL after ``timeout``."""
        if self._proc is not None:
            await self._proc.stop(timeout)

    def kill(self) -> None:
        """Crash it (SIGKILL). The data directory stays for a later ``start()``."""
        if self._proc is not None:
            self._proc.kill()

    def pause(self) -> None:
        """SIGSTOP: the socket stays open but nothing answers (calls time out)."""
        if self._proc is not None:
            self._proc.sigstop()

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.sigcont()

    async def enable_auth(self, root_password: str, **users: str) -> None:
        """``auth enable`` with a ``root`` user (all permissions) and ``users`` without
        any role (etcd then answers "permission denied" to them). Plain (non-TLS) only."""
        if self.tls:
            raise ValueError("enable_auth runs etcdctl over plain HTTP")

        def etcdctl(*args: str) -> None:
            argv = ["etcdctl", f"--endpoints={self.client_url}", "--dial-timeout=3s", *args]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=15)
            if proc.returncode != 0:
                raise RuntimeError(f"etcdctl {' '.join(args)} failed: {proc.stderr}")

        for name, password in {"root": root_password, **users}.items():
            await asyncio.to_thread(etcdctl, "user", "add", f"{name}:{password}")
        await asyncio.to_thread(etcdctl, "auth", "enable")

    def log(self) -> str:
        return self._proc.tail(200) if self._proc is not None else ""

    async def close(self) -> None:
        """Kill the server and remove the data directory if we created it."""
        try:
            self.kill()
        finally:
            if self._own_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    async def __aenter__(self) -> PrivateEtcd:
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
