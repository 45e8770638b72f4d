"""Shared fixtures: real PostgreSQL, RabbitMQ and etcd, isolated per test session.

- PostgreSQL: a fresh database ``duetime_test_<random>`` per session, migrated, dropped
  at the end (``DUETIME_TEST_DATABASE_URL`` points at the server to use).
- RabbitMQ: a fresh vhost per session when ``rabbitmqctl`` is usable (it is on the dev
  machine and in CI), otherwise the URL as given and unique queue names per test
  (``DUETIME_TEST_AMQP_URL``).
- etcd: ``DUETIME_TEST_ETCD_ENDPOINTS`` (default the ``make services`` etcd), with a
  unique key prefix per test (the ``unique`` fixture).

When a service does not answer and a Docker engine does, testcontainers starts one;
when neither, the session fails at once with a message saying what to start. Nothing
is skipped silently.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from scheduler import db
from scheduler.config import Settings, load_settings
from scheduler.log import configure_logging
from scheduler.migrate import migrate
from tests.fixtures_tasks.basic import EFFECTS_DDL, EFFECTS_TABLE
from tests.fixtures_tasks.jobs import declare
from tests.support.helpers import declare_queues, delete_job_queue
from tests.support.procs import Processes

configure_logging("warning", "console")

RUN_ID = uuid.uuid4().hex[:8]
PG_URL = os.environ.get(
    "DUETIME_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
AMQP_URL = os.environ.get("DUETIME_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
ETCD_ENDPOINTS = os.environ.get("DUETIME_TEST_ETCD_ENDPOINTS", "127.0.0.1:2379")


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _require(name: str, url_host: str, port: int, hint: str) -> None:
    if _port_open(url_host, port):
        return
    pytest.exit(
        f"{name} is not reachable at {url_host}:{port} and no Docker engine answers for "
        f"testcontainers. Start it: {hint}",
        returncode=3,
    )


def _with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


class _Containers:
    """Services started by testcontainers when a local service is missing."""

    def __init__(self) -> None:
        self.started: list[Any] = []

    def stop(self) -> None:
        for container in self.started:
            container.stop()


_containers = _Containers()


def _ensure_services() -> tuple[str, str, str]:
    pg, amqp, etcd = PG_URL, AMQP_URL, ETCD_ENDPOINTS
    docker = None
    pg_parts = urlsplit(pg)
    if not _port_open(pg_parts.hostname or "127.0.0.1", pg_parts.port or 5432):
        docker = _docker_available()
        if docker:
            from testcontainers.postgres import PostgresContainer

            container = PostgresContainer("postgres:15").start()
            _containers.started.append(container)
            pg = container.get_connection_url().replace("+psycopg2", "")
        else:
            _require(
                "PostgreSQL",
                pg_parts.hostname or "127.0.0.1",
                pg_parts.port or 5432,
                "the machine's PostgreSQL (make services)",
            )
    amqp_parts = urlsplit(amqp)
    if not _port_open(amqp_parts.hostname or "127.0.0.1", amqp_parts.port or 5672):
        docker = _docker_available() if docker is None else docker
        if docker:
            from testcontainers.rabbitmq import RabbitMqContainer

            container = RabbitMqContainer("rabbitmq:3.13").start()
            _containers.started.append(container)
            amqp = (
                f"amqp://guest:guest@{container.get_container_host_ip()}:"
                f"{container.get_exposed_port(5672)}/"
            )
        else:
            _require(
                "RabbitMQ",
                amqp_parts.hostname or "127.0.0.1",
                amqp_parts.port or 5672,
                "rabbitmq-server -detached (make services)",
            )
    host, _, port = etcd.split(",")[0].rpartition(":")
    if not _port_open(host, int(port)):
        docker = _docker_available() if docker is None else docker
        if docker:
            from testcontainers.core.container import DockerContainer

            container = (
                DockerContainer("quay.io/coreos/etcd:v3.5.15")
                .with_command(
                    "etcd --listen-client-urls http://0.0.0.0:2379 "
                    "--advertise-client-urls http://127.0.0.1:2379"
                )
                .with_exposed_ports(2379)
                .start()
            )
            _containers.started.append(container)
            etcd = f"{container.get_container_host_ip()}:{container.get_exposed_port(2379)}"
        else:
            _require("etcd", host, int(port), "make services (installs and starts etcd)")
    return pg, amqp, etcd


def _rabbitmqctl(*args: str) -> bool:
    if shutil.which("rabbitmqctl") is None:
        return False
    try:
        return (
            subprocess.run(["rabbitmqctl", *args], capture_output=True, timeout=60).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def services() -> Iterator[tuple[str, str, str]]:
    found = _ensure_services()
    yield found
    _containers.stop()


@pytest.fixture(scope="session")
def server_dsn(services: tuple[str, str, str]) -> str:
    return services[0]


@pytest.fixture(scope="session")
def amqp_url(services: tuple[str, str, str]) -> Iterator[str]:
    url = services[1]
    parts = urlsplit(url)
    vhost = f"duetime_test_{RUN_ID}"
    if "DUETIME_TEST_AMQP_URL" not in os.environ and parts.hostname in ("127.0.0.1", "localhost"):
        if _rabbitmqctl("add_vhost", vhost) and _rabbitmqctl(
            "set_permissions", "-p", vhost, parts.username or "guest", ".*", ".*", ".*"
        ):
            yield urlunsplit((parts.scheme, parts.netloc, "/" + vhost, parts.query, ""))
            _rabbitmqctl("delete_vhost", vhost)
            return
    yield url


@pytest.fixture(scope="session")
def etcd_endpoints(services: tuple[str, str, str]) -> str:
    return services[2]


async def create_database(server: str, name: str) -> str:
    conn = await asyncpg.connect(server, timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return _with_db(server, name)


async def drop_database(server: str, name: str) -> None:
    conn = await asyncpg.connect(server, timeout=10)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@asynccontextmanager
async def own_database(server: str, suffix: str) -> AsyncIterator[str]:
    """A migrated database of its own (``duetime_test_<run>_<suffix>``), dropped after.

    For test modules whose rows must not be seen by other tests' dispatchers (due
    pending jobs in the shared session database would be claimed by them)."""
    name = f"duetime_test_{RUN_ID}_{suffix}"
    url = await create_database(server, name)
    try:
        await migrate(url)
        yield url
    finally:
        await drop_database(server, name)


@pytest.fixture(scope="session")
async def dsn(server_dsn: str) -> AsyncIterator[str]:
    """A migrated database for this test session."""
    name = f"duetime_test_{RUN_ID}"
    url = await create_database(server_dsn, name)
    await migrate(url)
    yield url
    await drop_database(server_dsn, name)


@pytest.fixture
async def fresh_dsn(server_dsn: str) -> AsyncIterator[str]:
    """An empty (unmigrated) database of its own for one test."""
    name = f"duetime_test_{RUN_ID}_{uuid.uuid4().hex[:6]}"
    url = await create_database(server_dsn, name)
    yield url
    await drop_database(server_dsn, name)


@pytest.fixture
async def migrated_dsn(fresh_dsn: str) -> str:
    """A migrated database of its own for one test (tests that need an empty jobs table)."""
    await migrate(fresh_dsn)
    return fresh_dsn


@pytest.fixture(scope="session")
async def db_pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(dsn, max_size=10)
    yield pool
    await pool.close()


@pytest.fixture
def unique() -> str:
    """A short unique token for key prefixes, queue names, node ids."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def settings(dsn: str, amqp_url: str, etcd_endpoints: str, unique: str) -> Settings:
    """Settings for this test: session database, session vhost, a unique etcd prefix."""
    return load_settings(
        env={},
        overrides={
            "database_url": dsn,
            "amqp_url": amqp_url,
            "etcd_endpoints": etcd_endpoints,
            "etcd_prefix": f"duetime-test/{unique}",
            "node_id": f"test-{unique}",
            "lease_ttl": 2.0,
            "log_format": "console",
        },
    )


@pytest.fixture
def test_env(dsn: str, amqp_url: str, etcd_endpoints: str, unique: str) -> dict[str, str]:
    """Environment for child processes (duetime CLI, replicas, workers) of this test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
    env.update(
        DUETIME_DATABASE_URL=dsn,
        DUETIME_AMQP_URL=amqp_url,
        DUETIME_ETCD_ENDPOINTS=etcd_endpoints,
        DUETIME_ETCD_PREFIX=f"duetime-test/{unique}",
        DUETIME_LEASE_TTL="2",
        DUETIME_LOG_FORMAT="json",
    )
    return env


@pytest.fixture
async def channel(amqp_url: str) -> AsyncIterator[AbstractChannel]:
    """A plain channel on the session vhost: the test's own view of the broker."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        yield await connection.channel()
    finally:
        await connection.close()


@pytest.fixture
def procs(tmp_path: Any) -> Iterator[Processes]:
    """Child processes of this test (logs under ``tmp_path``), all killed at teardown."""
    with Processes(tmp_path) as group:
        yield group


@pytest.fixture(scope="session")
async def effects_table(db_pool: asyncpg.Pool) -> str:
    """The table ``tests.fixtures_tasks.basic`` handlers write their effects to."""
    await db_pool.execute(EFFECTS_DDL)
    return EFFECTS_TABLE


@pytest.fixture
async def queue(
    channel: AbstractChannel, db_pool: asyncpg.Pool, effects_table: str, unique: str
) -> AsyncIterator[str]:
    """A job queue of this test's own (declared in duetime.queues of the session database
    and on the broker with duetime's arguments), deleted from the broker after."""
    name = f"q-{unique}"
    await declare_queues(db_pool, name)
    await declare(channel, name)
    yield name
    with contextlib.suppress(Exception):
        await delete_job_queue(channel, name)
