"""A private PostgreSQL primary and synchronous standby, for switchover tests.

What a Patroni cluster in ``synchronous_mode`` gives each shard, without Patroni: a
primary streaming to a standby that was cloned with ``pg_basebackup -R``, and
``synchronous_standby_names`` naming that standby, so a commit is acknowledged only once
the standby has flushed it. A test then does what Patroni does on a crash: stop the
primary (``immediate`` is a crash: no shutdown checkpoint, sessions just vanish) and
``promote()`` the standby; the old primary stays down.

Everything lives in one temporary directory (both data directories, their Unix sockets
and logs) on free loopback ports, so nothing here touches another server on the machine.
initdb and postgres refuse to run as root; as root the pair runs as ``postgres`` (or
``nobody``) through ``runuser``, the directory chowned to it (``tests.support.pg``).
``cleanup()`` stops whatever still runs with ``-m immediate`` and removes the directory;
the pair is a context manager, so it runs whatever happened.

``synchronous_standby_names`` is given on the primary's command line, not in its
configuration file: the standby's copy of the configuration therefore does not carry it,
and once promoted the new primary commits alone (what Patroni's non-strict
``synchronous_mode`` does while the old primary is away) instead of waiting for a
standby that is gone. ``fsync`` is off, as in ``PrivatePostgres``: a stopped server is
not a lost page cache, and the test is about what each server acknowledged, not disks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import asyncpg

from tests.support.etcd import free_port
from tests.support.pg import PG_BIN, _run_as_user, run_pg_command, start_on_a_free_port, tail

__all__ = ["PgNode", "PgPair"]

_START_TIMEOUT = 30
STANDBY_NAME = "pg2"
HBA = """\
# private test pair: trust on loopback and the Unix socket, replication included
local   all          all                 trust
local   replication  all                 trust
host    all          all   127.0.0.1/32  trust
host    replication  all   127.0.0.1/32  trust
"""


class PgNode:
    """One server of the pair: its data directory, port, and pg_ctl."""

    def __init__(self, name: str, base_dir: Path, user: str | None) -> None:
        self.name = name
        self.dir = base_dir / name
        self.data_dir = self.dir / "data"
        self.port = free_port()
        self.user = user
        self.options: list[str] = []
        self._created = False
        self._started = False

    # -- addresses --------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@{self.address}/{database}"

    # -- commands ---------------------------------------------------------------------

    def _cmd(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return run_pg_command(argv, user=self.user, timeout=timeout, log=self.log)

    def _mkdir(self) -> None:
        self.dir.mkdir(mode=0o700)
        if self.user is not None:
            shutil.chown(self.dir, self.user)

    def initdb(self) -> None:
        self._mkdir()
        self._created = True
        self._cmd(
            [str(PG_BIN / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
             "--auth=trust", "--no-sync", "-E", "UTF8"],
            timeout=60,
        )  # fmt: skip
        hba = self.data_dir / "pg_hba.conf"
        hba.write_text(HBA)
        if self.user is not None:
            shutil.chown(hba, self.user)

    def basebackup_from(self, primary: PgNode) -> None:
        """Clone ``primary`` with ``-R`` (standby.signal and primary_conninfo written)."""
        self._mkdir()
        self._created = True
        self._cmd(
            [str(PG_BIN / "pg_basebackup"), "-D", str(self.data_dir), "-h", "127.0.0.1",
             "-p", str(primary.port), "-U", "postgres", "-R", "-X", "stream",
             "-c", "fast", "--no-sync"],
            timeout=60,
        )  # fmt: skip

    @property
    def _log_path(self) -> Path:
        return self.dir / "postgres.log"

    def log(self, lines: int = 40) -> str:
        return tail(self._log_path, lines)

    def start(self) -> None:
        """pg_ctl start; returns once the server accepts connections. The port is picked
        when the node is made and bound seconds later (after the primary's base
        backup), and a client connection may be given it as its ephemeral port
        meanwhile: a first start that finds it taken tries another free port. A restart
        keeps its port, which the DSNs handed out already name."""
        if self._started:
            self._pg_ctl_start()
        else:
            start_on_a_free_port(self._pg_ctl_start, self.log, self._repick_port)
        self._started = True

    def _repick_port(self) -> None:
        self.port = free_port()

    def _pg_ctl_start(self) -> None:
        options = [
            f"-p {self.port}",
            f"-k {self.dir}",
            "-c listen_addresses=127.0.0.1",
            "-c fsync=off",
            "-c wal_level=replica",
            "-c max_wal_senders=5",
            f"-c cluster_name={self.name}",  # the walreceiver's application_name
            *self.options,
        ]
        self._cmd(
            [str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self._log_path),
             "-o", " ".join(options), "-w", "-t", str(_START_TIMEOUT), "start"],
            timeout=_START_TIMEOUT + 10,
        )  # fmt: skip

    def running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()

    def stop(self, mode: str = "fast") -> None:
        """``fast``: sessions get 57P01 and the remaining WAL is shipped to the standby
        (a planned switchover); ``immediate``: the postmaster SIGQUITs everything at
        once (a crash, as far as clients and the standby can tell)."""
        if mode not in ("fast", "immediate", "smart"):
            raise ValueError(f"unknown stop mode {mode!r}")
        self._cmd(
            [str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "-t", "20",
             "stop"],
            timeout=30,
        )  # fmt: skip

    def promote(self) -> None:
        """Promote a standby and wait until it accepts writes (``pg_ctl promote -w``)."""
        self._cmd(
            [str(PG_BIN / "pg_ctl"), "-D", str(self.data_dir), "-w", "-t", "30", "promote"],
            timeout=40,
        )  # fmt: skip

    async def in_recovery(self) -> bool:
        conn = await asyncpg.connect(self.dsn(), timeout=5)
        try:
            return bool(await conn.fetchval("SELECT pg_is_in_recovery()"))
        finally:
            await conn.close()

    def kill(self) -> None:
        """Last resort when pg_ctl cannot stop it: SIGKILL the postmaster."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, 9)


class PgPair:
    """``primary`` (pg1) and its synchronous standby ``standby`` (pg2)."""

    def __init__(self) -> None:
        self.user = _run_as_user()
        self.base_dir = Path(tempfile.mkdtemp(prefix="duetime-pgpair-"))
        if self.user is not None:
            shutil.chown(self.base_dir, self.user)
        self.primary = PgNode("pg1", self.base_dir, self.user)
        self.standby = PgNode(STANDBY_NAME, self.base_dir, self.user)
        self.primary.options = [f"-c synchronous_standby_names={STANDBY_NAME}"]

    def multi_host_dsn(self, database: str) -> str:
        """Both nodes, primary first, only a writable one accepted: what duetime is given."""
        return (
            f"postgresql://postgres@{self.primary.address},{self.standby.address}/{database}"
            "?target_session_attrs=read-write"
        )

    async def start(self) -> PgPair:
        """initdb and start the primary, clone and start the standby, and return once
        the standby streams as the primary's synchronous standby."""
        self.primary.initdb()
        await asyncio.to_thread(self.primary.start)
        await asyncio.to_thread(self.standby.basebackup_from, self.primary)
        await asyncio.to_thread(self.standby.start)
        await self.wait_sync()
        return self

    async def wait_sync(self, timeout: float = 30.0) -> None:
        """Until ``pg_stat_replication`` on the primary shows the standby as ``sync``."""
        deadline = time.monotonic() + timeout
        conn = await asyncpg.connect(self.primary.dsn(), timeout=5)
        try:
            while True:
                state = await conn.fetchval(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = $1",
                    STANDBY_NAME,
                )
                if state == "sync":
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"standby not synchronous after {timeout}s (state {state!r})\n"
                        f"{self.standby.log()}"
                    )
                await asyncio.sleep(0.1)
        finally:
            await conn.close()

    def cleanup(self) -> None:
        """Stop what runs (immediate; SIGKILL if pg_ctl fails) and remove the directory."""
        try:
            for node in (self.primary, self.standby):
                if node._created and node.running():
                    try:
                        node.stop("immediate")
                    except (RuntimeError, subprocess.TimeoutExpired):
                        node.kill()
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    async def __aenter__(self) -> PgPair:
        try:
            return await self.start()
        except BaseException:
            self.cleanup()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
