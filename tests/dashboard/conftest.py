"""A real dashboard against a real cluster, driven by a real browser.

- ``dash_dsn``: a migrated database of this module's own: the module's scheduler
  dispatches from it, and its counts are not disturbed by other tests' rows.
- ``cluster``: one ``duetime scheduler`` replica and one ``duetime worker`` (handlers
  from ``tests.fixtures_tasks.basic``) on the module's queue, started once per module.
- ``dashboard`` / ``read_only_dashboard`` / ``token_dashboard``: ``duetime dashboard``
  processes on free loopback ports, waited for through ``/healthz``.
- ``browser``: Debian's chromium through Playwright (``playwright install`` cannot
  download a browser here). Without ``/usr/bin/chromium`` the browser tests skip with
  that reason, and fail under CI (``CI`` set), where .ci/run installs it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from scheduler import db
from tests.conftest import own_database
from tests.fixtures_tasks.basic import EFFECTS_DDL
from tests.support.helpers import declare_queues
from tests.support.procs import ChildProcess, Processes, duetime_argv
from tests.support.wait import wait_for

CHROMIUM = os.environ.get("DUETIME_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",  # containers often have a 64 MB /dev/shm
]
TASKS = "tests.fixtures_tasks.basic"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except OSError:
        return 0


@dataclass
class Served:
    url: str
    process: ChildProcess


@dataclass
class Cluster:
    dsn: str
    env: dict[str, str]
    queue: str
    pool: asyncpg.Pool
    procs: Processes

    async def start_dashboard(self, *flags: str, env: dict[str, str] | None = None) -> Served:
        port = free_port()
        child = self.procs.spawn(
            duetime_argv("dashboard", "--listen", f"127.0.0.1:{port}", *flags),
            name=f"dashboard-{port}",
            env={**self.env, **(env or {})},
        )
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            if not child.running():
                raise AssertionError(f"dashboard exited:\n{child.tail()}")
            return http_status(url + "/healthz") == 200

        await wait_for(lambda: asyncio.to_thread(up), timeout=20, message="dashboard /healthz")
        return Served(url, child)


@pytest.fixture(scope="module")
async def dash_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, f"dash_{uuid.uuid4().hex[:6]}") as url:
        yield url


@pytest.fixture(scope="module")
async def cluster(
    dash_dsn: str, amqp_url: str, etcd_endpoints: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Cluster]:
    token = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
    env.update(
        DUETIME_DATABASE_URL=dash_dsn,
        DUETIME_AMQP_URL=amqp_url,
        DUETIME_ETCD_ENDPOINTS=etcd_endpoints,
        DUETIME_ETCD_PREFIX=f"duetime-test/dash-{token}",
        DUETIME_LEASE_TTL="2",
        DUETIME_LOG_FORMAT="json",
    )
    pool = await db.create_pool(dash_dsn, max_size=4)
    await pool.execute(EFFECTS_DDL)
    await declare_queues(pool, f"dash-{token}")
    with Processes(tmp_path_factory.mktemp("dash-procs")) as procs:
        yield Cluster(dash_dsn, env, f"dash-{token}", pool, procs)
        await procs.stop_all(timeout=10)
    await pool.close()


@pytest.fixture(scope="module")
async def workers_running(cluster: Cluster) -> Cluster:
    """A scheduler replica (leader once fenced) and a worker on ``cluster.queue``."""
    replica = cluster.procs.spawn(
        duetime_argv("scheduler"), name="scheduler", env={**cluster.env, "DUETIME_NODE_ID": "r1"}
    )
    worker = cluster.procs.spawn(
        duetime_argv("worker", "--import", TASKS, "--queue", cluster.queue, "--concurrency", "4"),
        name="worker",
        env={**cluster.env, "DUETIME_NODE_ID": "w1"},
    )

    async def fenced() -> bool:
        if not replica.running() or not worker.running():
            raise AssertionError(f"exited:\n{replica.tail()}\n{worker.tail()}")
        return bool(await cluster.pool.fetchval("SELECT epoch FROM duetime.leader_fence"))

    await wait_for(fenced, timeout=30, message="a leader fenced the module database")
    return cluster


@pytest.fixture(scope="module")
async def dashboard(cluster: Cluster) -> Served:
    return await cluster.start_dashboard()


@pytest.fixture(scope="module")
def chromium_path() -> str:
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        reason = (
            f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium); "
            ".ci/run does so in CI"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return CHROMIUM if Path(CHROMIUM).exists() else str(shutil.which("chromium"))


@pytest.fixture(scope="module")
async def browser(chromium_path: str) -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        launched = await p.chromium.launch(
            executable_path=chromium_path, args=CHROMIUM_ARGS, headless=True
        )
        yield launched
        await launched.close()


@pytest.fixture
async def page(browser: Any) -> AsyncIterator[Any]:
    context = await browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(15_000)
    tab = await context.new_page()
    yield tab
    await context.close()
