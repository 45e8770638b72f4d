"""A private PgBouncer in transaction mode in front of the shared PostgreSQL.

``PrivatePgBouncer`` writes a configuration into a temporary directory and runs Debian's
``pgbouncer`` (1.18: no protocol-level prepared statements) on a free loopback port, as
a child process that ``stop()`` (always in ``finally``: it is a context manager) kills.
Every database name is forwarded to the server given (``* = host=... port=...``), with a
small server pool per database and user (``pool_size``), so a test sees clients share
server sessions. PgBouncer refuses to run as root: as root it runs as ``postgres``
(else ``nobody``) through ``runuser``, like ``tests.support.pg``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from tests.support.etcd import free_port
from tests.support.pg import _run_as_user, tail

__all__ = ["PGBOUNCER", "PrivatePgBouncer"]

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


class PrivatePgBouncer:
    def __init__(self, server_host: str, server_port: int, *, pool_size: int = 4) -> None:
        self.port = free_port()
        self.base_dir = Path(tempfile.mkdtemp(prefix="duetime-pgbouncer-"))
        self.user = _run_as_user()
        self._server = (server_host, server_port)
        self._pool_size = pool_size
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def _log_path(self) -> Path:
        return self.base_dir / "pgbouncer.log"

    def log(self, lines: int = 40) -> str:
        return tail(self._log_path, lines)

    def url(self, user: str, database: str) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def start(self) -> PrivatePgBouncer:
        host, port = self._server
        (self.base_dir / "users.txt").write_text('"postgres" ""\n')
        ini = self.base_dir / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.base_dir / 'users.txt'}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self._pool_size}\n"
            "max_client_conn = 500\n"
            f"logfile = {self._log_path}\n"
            "server_reset_query =\n"
        )
        os.chmod(self.base_dir, 0o755)
        if self.user is not None:
            for path in (self.base_dir, ini, self.base_dir / "users.txt"):
                shutil.chown(path, self.user)
        argv = [PGBOUNCER, str(ini)]
        if self.user is not None:
            argv = ["runuser", "-u", self.user, "--", *argv]
        self._proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited ({self._proc.returncode}):\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen on {self.port} within 15 s:\n{self.log()}")

    def stop(self) -> None:
        """Kill it and remove the directory. Safe to call twice."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=10)
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> PrivatePgBouncer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
