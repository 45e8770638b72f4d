"""A private PostgreSQL cluster for tests that need server settings of their own.

The shared server (``DUETIME_TEST_DATABASE_URL``) cannot be reconfigured by a test:
TLS on, a chosen ``pg_hba.conf``, client-certificate authentication. ``PrivatePostgres``
runs ``initdb`` into a temporary directory and ``pg_ctl start`` on a free loopback port
with its Unix socket in that directory, so nothing it does can disturb anything else on
the machine; ``stop()`` (always in ``finally``: the class is a context manager) stops it
with ``-m immediate`` and removes the directory.

initdb and postgres refuse to run as root. When the tests run as root (containers,
this dev machine) the cluster runs as an unprivileged OS user (``postgres`` when it
exists, else ``nobody``) through ``runuser``, and the directory is chowned to it; as any
other user it runs as that user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from tests.support.etcd import free_port

__all__ = ["PG_BIN", "PrivatePostgres"]

PG_BIN = Path(os.environ.get("DUETIME_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
_START_TIMEOUT = 30
#: Starts tried, each on a new free port, when the picked one was taken meanwhile.
PORT_ATTEMPTS = 3


def _run_as_user() -> str | None:
    """The OS user to run the cluster as, or None to run as ourselves."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and no unprivileged user to run PostgreSQL as")


def run_pg_command(
    argv: list[str], *, user: str | None, timeout: float, log: Callable[[], str]
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL binary (as ``user`` when root may not: initdb refuses root);
    a failure raises with its output and the server log's tail."""
    if user is not None:
        argv = ["runuser", "-u", user, "--", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}\n{log()}"
        )
    return proc


def start_on_a_free_port(
    start: Callable[[], None], log: Callable[[int], str], repick: Callable[[], None]
) -> None:
    """``start`` a cluster on the port it was given, or, when that port was bound by
    someone else meanwhile (its log says so), ``repick`` a free one and start again, up
    to ``PORT_ATTEMPTS`` times. Any other failure raises at once."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            start()
            return
        except RuntimeError:
            if "Address already in use" not in log(5) or attempt == PORT_ATTEMPTS - 1:
                raise
            repick()


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` of a server log ("" while there is none)."""
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text().splitlines()[-lines:])
    return ""


class PrivatePostgres:
    """One throwaway cluster. ``settings`` are passed as ``-c name=value`` at start;
    ``hba`` replaces ``pg_hba.conf``; ``files`` are copied into the cluster directory
    (owned by the cluster's user, mode 0600) and may be referenced in settings as
    ``{dir}/<name>``."""

    def __init__(
        self,
        *,
        settings: dict[str, str] | None = None,
        hba: str | None = None,
        files: dict[str, Path] | None = None,
    ) -> None:
        self.base_dir = Path(tempfile.mkdtemp(prefix="duetime-pg-"))
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir  # short path: sockets are limited to ~100 bytes
        self.port = free_port()
        self.user = _run_as_user()
        self._settings = dict(settings or {})
        self._hba = hba
        self._files = dict(files or {})
        self._started = False

    # -- addresses --------------------------------------------------------------------

    @property
    def admin_dsn(self) -> str:
        """Superuser ``postgres`` over the Unix socket (trust): for setting up roles."""
        return f"postgresql://postgres@/postgres?host={self.socket_dir}&port={self.port}"

    def tcp_dsn(self, user: str, database: str = "postgres", password: str | None = None,
                **params: str) -> str:  # fmt: skip
        """``postgresql://user[:password]@127.0.0.1:<port>/database?params``."""
        auth = f"{user}:{password}" if password is not None else user
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}" + (
            f"?{query}" if query else ""
        )

    # -- lifecycle --------------------------------------------------------------------

    def _cmd(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return run_pg_command(argv, user=self.user, timeout=timeout, log=self.log)

    def start(self) -> PrivatePostgres:
        """initdb, install files and pg_hba.conf, start; returns once it accepts. The
        port is picked when the cluster is made and bound after initdb, and a client
        connection may be given it as its ephemeral port meanwhile: a start that finds
        it taken tries another free port."""
        if self.user is not None:
            shutil.chown(self.base_dir, self.user)
        self._cmd(
            [str(PG_BIN / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
             "--auth=trust", "--no-sync", "-E", "UTF8"],
            timeout=60,
        )  # fmt: skip
        for name, source in self._files.items():
            target = self.base_dir / name
            shutil.copyfile(source, target)
            os.chmod(target, 0o600)
            if self.user is not None:
                shutil.chown(target, self.user)
        if self._hba is not None:
            hba = self.data_dir / "pg_hba.conf"
            hba.write_text(self._hba)
            if self.user is not None:
                shutil.chown(hba, self.user)
        self._started = True  # from here on, stop() must run even if start fails
        start_on_a_free_port(self._pg_ctl_start, self.log, self._repick_port)
        return self

    def _repick_port(self) -> None:
        self.port = free_port()

    def _pg_ctl_start(self) -> None:
        options = [
            f"-p {self.port}",
            f"-k {self.socket_dir}",
            "-c listen_addresses=127.0.0.1",
            "-c fsync=off",
            *(f"-c {k}={v.format(dir=self.base_dir)}" for k, v in self._settings.items()),
        ]
        self._cmd(
            [str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self._log_path),
             "-o", " ".join(options), "-w", "-t", str(_START_TIMEOUT), "start"],
            timeout=_START_TIMEOUT + 10,
        )  # fmt: skip

    @property
    def _log_path(self) -> Path:
        return self.base_dir / "postgres.log"

    def log(self, lines: int = 40) -> str:
        return tail(self._log_path, lines)

    def stop(self) -> None:
        """Stop at once (``-m immediate``) and remove the directory. Safe to call twice."""
        try:
            if self._started and (self.data_dir / "postmaster.pid").exists():
                try:
                    self._cmd(
                        [str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate",
                         "-w", "-t", "10", "stop"],
                        timeout=20,
                    )  # fmt: skip
                except (RuntimeError, subprocess.TimeoutExpired):
                    self._kill_postmaster()
        finally:
            self._started = False
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def _kill_postmaster(self) -> None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, 9)

    def __enter__(self) -> PrivatePostgres:
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
