"""A scenario's private world: scratch database, queue, etcd prefix, and its processes.

``Sandbox`` creates ``duetime_bench_<scenario>_<hex>`` on the PostgreSQL server, migrates
it, adds the ``bench_starts`` table the handler writes to, and picks a queue and an etcd
prefix nobody else uses. It starts real ``duetime scheduler`` / ``duetime worker``
processes (tests/support/procs.py: own process group, output in a log file, killed at
exit whatever happens), waits until they say they are ready (the replica's ``leading``
line, the worker's ``worker_started``), and on exit stops them politely, drops the
database and deletes the queue.
"""

from __future__ import annotations

import asyncio
import os
import platform
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import asyncpg

from bench.tasks import STARTS_DDL, STARTS_TABLE
from scheduler import broker, db
from scheduler.config import Settings, load_settings
from scheduler.migrate import migrate
from scheduler.store.limits import LimitStore
from scheduler.store.queues import QueueStore
from tests.support.procs import ChildProcess, Processes, duetime_argv

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 60.0


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


@asynccontextmanager
async def scratch_database(server_url: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A migrated database of its own for a standalone benchmark script
    (``duetime_bench_<hex>`` on ``server_url``'s server), dropped after. Yields its URL and
    the result's head: the machine (cores, PostgreSQL, Python, load average at start;
    the load at the end is added on the way out) and the start time."""
    name = f"duetime_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(server_url, timeout=10)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        version = await admin.fetchval("SHOW server_version")
    finally:
        await admin.close()
    head: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "postgresql": version,
            "python": platform.python_version(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    url = with_database(server_url, name)
    try:
        await migrate(url)
        yield url, head
    finally:
        admin = await asyncpg.connect(server_url, timeout=10)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
        head["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]


@dataclass(frozen=True)
class Services:
    """Where the local services are; scenarios create what they need on them."""

    server_url: str  # any database we may connect to, for CREATE/DROP DATABASE
    amqp_url: str
    etcd_endpoints: str

    @classmethod
    def from_settings(cls, settings: Settings, server_url: str | None = None) -> Services:
        return cls(
            server_url=server_url or with_database(settings.database_url, "postgres"),
            amqp_url=settings.amqp_url,
            etcd_endpoints=",".join(settings.etcd_endpoints),
        )


class Sandbox:
    """``async with Sandbox(services, "storm") as sb:`` — everything private to one run."""

    def __init__(self, services: Services, scenario: str, *, log_dir: Path | None = None) -> None:
        token = uuid.uuid4().hex[:8]
        self.services = services
        self.scenario = scenario
        self.db_name = f"duetime_bench_{scenario}_{token}"
        self.dsn = with_database(services.server_url, self.db_name)
        self.queue = f"bench-{scenario}-{token}"
        self.prefix = f"duetime-bench/{scenario}-{token}"
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"duetime-bench-{scenario}-"))
        self.procs = Processes(self.log_dir)
        self.pool: asyncpg.Pool | None = None
        self._n = 0

    # -- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> Sandbox:
        admin = await asyncpg.connect(self.services.server_url, timeout=10)
        try:
            await admin.execute(f'CREATE DATABASE "{self.db_name}"')
        finally:
            await admin.close()
        try:
            await migrate(self.dsn)
            self.pool = await db.create_pool(self.dsn, min_size=1, max_size=4, timeout=30)
            await self.pool.execute(STARTS_DDL)
            await QueueStore(self.pool).add(self.queue)  # only declared queues dispatch
        except BaseException:
            await self._drop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.procs.stop_all(timeout=10)
        finally:
            self.procs.kill_all()
            if self.pool is not None:
                await self.pool.close()
            await self._drop()
            await self._delete_queue()

    async def _drop(self) -> None:
        admin = await asyncpg.connect(self.services.server_url, timeout=10)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
        finally:
            await admin.close()

    async def _delete_queue(self) -> None:
        try:
            connection = await aio_pika.connect(self.services.amqp_url, timeout=10)
        except Exception:  # the broker is gone: nothing to clean
            return
        async with connection:
            channel = await connection.channel()
            for name in broker.job_queue_names(self.queue):
                await channel.queue_delete(name)

    @property
    def db(self) -> asyncpg.Pool:
        assert self.pool is not None, "Sandbox used outside 'async with'"
        return self.pool

    # -- configuration ----------------------------------------------------------------

    def settings(self, **overrides: Any) -> Settings:
        """Settings for in-process parts (baseline, scale's claim probe)."""
        values: dict[str, Any] = {
            "database_url": self.dsn,
            "amqp_url": self.services.amqp_url,
            "etcd_endpoints": self.services.etcd_endpoints,
            "etcd_prefix": self.prefix,
            "node_id": f"bench-{self.scenario}",
            "log_level": "warning",
        }
        values.update(overrides)
        return load_settings(env={}, overrides=values)

    def env(self, node_id: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
        env.update(
            DUETIME_DATABASE_URL=self.dsn,
            DUETIME_AMQP_URL=self.services.amqp_url,
            DUETIME_ETCD_ENDPOINTS=self.services.etcd_endpoints,
            DUETIME_ETCD_PREFIX=self.prefix,
            DUETIME_NODE_ID=node_id,
            DUETIME_LOG_FORMAT="json",
            DUETIME_LOG_LEVEL="info",
        )
        env.update(extra)
        return env

    # -- processes ---------------------------------------------------------------------

    async def start_scheduler(self, **extra_env: str) -> ChildProcess:
        """One replica; returns once it leads (its duties are running)."""
        self._n += 1
        node = f"bench-sched-{self._n}"
        child = self.procs.spawn(
            duetime_argv("scheduler"), name=node, env=self.env(node, **extra_env), cwd=REPO
        )
        await wait_for_line(child, '"leading"', READY_TIMEOUT)
        return child

    async def start_worker(self, concurrency: int, **extra_env: str) -> ChildProcess:
        """One ``duetime worker`` on this sandbox's queue; returns once it consumes."""
        self._n += 1
        node = f"bench-worker-{self._n}"
        argv = duetime_argv(
            "worker", "--import", "bench.tasks", "--queue", self.queue,
            "--concurrency", str(concurrency),
        )  # fmt: skip
        child = self.procs.spawn(argv, name=node, env=self.env(node, **extra_env), cwd=REPO)
        await wait_for_line(child, '"worker_started"', READY_TIMEOUT)
        return child

    # -- observations ------------------------------------------------------------------

    async def started_count(self) -> int:
        return int(await self.db.fetchval(f"SELECT count(DISTINCT job_id) FROM {STARTS_TABLE}"))

    async def wait_started(self, expected: int, timeout: float) -> int:
        """Poll until ``expected`` distinct jobs started or ``timeout``; return the count."""
        deadline = time.monotonic() + timeout
        seen = await self.started_count()
        while seen < expected and time.monotonic() < deadline:
            self._check_alive()
            await asyncio.sleep(0.2)
            seen = await self.started_count()
        return seen

    async def starts(self) -> list[asyncpg.Record]:
        """Per job: deliveries recorded, first handler start, due time (epoch seconds),
        and dispatched_at (database clock) from the job row."""
        return await self.db.fetch(
            f"""
            SELECT s.job_id, count(*) AS runs, min(s.started_at) AS started,
                   extract(epoch FROM s.due_at)::float8 AS due,
                   extract(epoch FROM max(j.dispatched_at))::float8 AS dispatched
              FROM {STARTS_TABLE} s
              LEFT JOIN duetime.jobs j ON j.id = s.job_id AND j.due_at = s.due_at
             GROUP BY s.job_id, s.due_at
            """
        )

    async def status_counts(self) -> dict[str, int]:
        rows = await self.db.fetch(
            "SELECT status, count(*) AS n FROM duetime.jobs WHERE queue = $1 GROUP BY status",
            self.queue,
        )
        return {r["status"]: r["n"] for r in rows}

    def _check_alive(self) -> None:
        for child in self.procs:
            if not child.running():
                raise RuntimeError(
                    f"{child.name} exited with {child.returncode}; tail:\n{child.tail()}"
                )


async def wait_for_line(child: ChildProcess, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while needle not in child.output():
        if not child.running():
            raise RuntimeError(f"{child.name} exited with {child.returncode}:\n{child.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} not ready after {timeout:.0f} s:\n{child.tail()}")
        await asyncio.sleep(0.05)


async def set_limits(pool: asyncpg.Pool, specs: Sequence[str]) -> list[str]:
    """``duetime bench --limit``: each ``TARGET=N`` (max_running N) or ``TARGET=N/s``
    (a rate, also /min, /h) set before the scenario starts; returns them as set. What a
    limit that does not bind costs (issue 23, target 6): a ``--limit`` far above the
    scenario's jobs."""
    done = []
    for spec in specs:
        target, _, value = spec.partition("=")
        store = LimitStore(pool)
        if "/" in value:
            await store.set(target, None, rate=value)
        else:
            await store.set(target, int(value))
        done.append(f"{target}={value}")
    return done
