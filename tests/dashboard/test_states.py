"""The dashboard as a process, and its empty and error states: PostgreSQL down (503
pages that say so, a live /healthz), an empty database with no leader, a graceful
SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

import pytest
from playwright.async_api import expect

from scheduler import db
from scheduler.planning import ScheduleSpec
from scheduler.planning.declared import ScheduleDeclaration
from scheduler.store.schedules import ScheduleStore
from tests.dashboard.conftest import Cluster, free_port
from tests.support.procs import Processes, duetime_argv
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


async def test_database_down_pages_say_so_and_healthz_stays_up(
    procs: Processes, etcd_endpoints: str, amqp_url: str, page: Any
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
    env.update(
        DUETIME_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere",
        DUETIME_AMQP_URL=amqp_url, DUETIME_ETCD_ENDPOINTS=etcd_endpoints,
        DUETIME_ETCD_PREFIX="duetime-test/dash-down", DUETIME_DB_TIMEOUT="1",
    )  # fmt: skip
    child = procs.spawn(duetime_argv("dashboard", "--listen", f"127.0.0.1:{port}"), env=env)
    url = f"http://127.0.0.1:{port}"

    async def healthz() -> dict[str, Any] | None:
        status, body = await asyncio.to_thread(get, url + "/healthz")
        return json.loads(body) if status == 200 else None

    health = await wait_for(healthz, timeout=20, message=f"healthz:\n{child.tail()}")
    assert health["database"] == "down"
    for path in ("/", "/jobs", "/schedules"):
        status, body = await asyncio.to_thread(get, url + path)
        assert status == 503 and "PostgreSQL unavailable" in body, (path, status)
    await page.goto(url + "/cluster")  # etcd and RabbitMQ still shown
    await expect(page.get_by_role("alert")).to_contain_text("PostgreSQL unavailable")
    await expect(page.locator("h2", has_text="Election (etcd)")).to_be_visible()


async def test_empty_database_reads_as_no_jobs_and_no_leader(
    cluster: Cluster, page: Any, migrated_dsn: str
) -> None:
    served = await cluster.start_dashboard(env={"DUETIME_DATABASE_URL": migrated_dsn})
    await page.goto(served.url + "/")
    await expect(page.get_by_text("No leader has fenced the database yet")).to_be_visible()
    await expect(page.get_by_text("No jobs yet.")).to_be_visible()
    await page.goto(served.url + "/schedules")
    await expect(page.get_by_text("No schedules.")).to_be_visible()
    await page.goto(served.url + "/jobs/12345")
    await expect(page.locator("h1")).to_have_text("Not found")


async def test_sigterm_stops_gracefully(cluster: Cluster) -> None:
    served = await cluster.start_dashboard()
    served.process.send(signal.SIGTERM)
    assert await served.process.wait(timeout=15) == 0, served.process.tail()
    assert "dashboard_stopped" in served.process.output()
    status, _ = await asyncio.to_thread(get, served.url + "/healthz")
    assert status == 0


async def test_schedule_page_says_which_declaration_manages_it(
    cluster: Cluster, migrated_dsn: str
) -> None:
    pool = await db.create_pool(migrated_dsn, max_size=2)
    try:
        store = ScheduleStore(pool)
        spec = ScheduleSpec(name="declared-one", task="tick", interval="1m")
        await store.apply(ScheduleDeclaration.of("billing", [spec]))
        await store.add(ScheduleSpec(name="by-hand", task="tick", interval="1m"))
    finally:
        await pool.close()
    served = await cluster.start_dashboard(env={"DUETIME_DATABASE_URL": migrated_dsn})
    status, body = await asyncio.to_thread(get, served.url + "/schedules/declared-one")
    assert status == 200 and "<code>billing</code> (schedules as code" in body
    status, body = await asyncio.to_thread(get, served.url + "/schedules/by-hand")
    assert status == 200 and "hand (CLI, API or SQL)" in body


async def test_a_staged_job_page_says_when_it_starts(
    cluster: Cluster, page: Any, migrated_dsn: str
) -> None:
    """Staged ahead (DESIGN §14): dispatched with heartbeat_at = its run time, still
    ahead; the job page says a worker holds it and when it starts."""
    from scheduler.store.fence import FenceStore

    pool = await db.create_pool(migrated_dsn, max_size=2)
    try:
        assert await FenceStore(pool).advance(1, "test-node")
        await pool.execute("INSERT INTO duetime.queues (name) VALUES ('q') ON CONFLICT DO NOTHING")
        staged, running = [
            await pool.fetchval(
                "INSERT INTO duetime.jobs (task, queue, due_at) VALUES ('t', 'q', now() + $1)"
                " RETURNING id",
                ahead,
            )
            for ahead in (timedelta(hours=1), timedelta(0))
        ]
        await pool.execute(
            "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(),"
            " dispatch_epoch = 1, heartbeat_at = coalesce(run_at, due_at)"
        )
    finally:
        await pool.close()
    served = await cluster.start_dashboard(env={"DUETIME_DATABASE_URL": migrated_dsn})
    await page.goto(served.url + f"/jobs/{staged}")
    await expect(page.get_by_test_id("job-staged")).to_contain_text("Staged")
    await page.goto(served.url + f"/jobs/{running}")
    await expect(page.get_by_test_id("job-status")).to_have_text("dispatched")
    await expect(page.get_by_test_id("job-staged")).to_have_count(0)
