"""The dashboard of a sharded cluster: two shards ``a`` and ``b``, each a migrated
database of its own, served by one ``duetime dashboard`` with ``DUETIME_SHARDS``.

Job ids and schedule names are per shard, so the same id and the same name are set up
on both shards with different contents: a page or an action that reached the wrong
shard shows or changes the other one's row, and every check reads both databases.
The unsharded dashboard of the other modules (``dashboard`` fixture) is checked to show
no shard picker and no ``shards`` in ``/healthz``.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from playwright.async_api import expect

from scheduler import db
from scheduler.jobspec import JobSpec
from scheduler.planning import ScheduleSpec
from scheduler.store import JobStore, ScheduleStore
from tests.conftest import own_database
from tests.dashboard.conftest import Cluster, Served, free_port
from tests.support.procs import Processes, duetime_argv
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)


@dataclass
class Shards:
    a: asyncpg.Pool
    b: asyncpg.Pool
    env: str  # DUETIME_SHARDS
    served: Served


@pytest.fixture(scope="module")
async def shards(cluster: Cluster, server_dsn: str) -> AsyncIterator[Shards]:
    token = uuid.uuid4().hex[:6]
    async with (
        own_database(server_dsn, f"sha_{token}") as a_url,
        own_database(server_dsn, f"shb_{token}") as b_url,
    ):
        a = await db.create_pool(a_url, max_size=2)
        b = await db.create_pool(b_url, max_size=2)
        env = f"a={a_url},b={b_url}"
        served = await cluster.start_dashboard(env={"DUETIME_SHARDS": env})
        try:
            yield Shards(a, b, env, served)
        finally:
            await served.process.stop(timeout=10)
            await a.close()
            await b.close()


def request(
    url: str, data: dict[str, str] | None = None, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data=body, headers=headers or {}), timeout=10
        ) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def get(url: str) -> tuple[int, str]:
    return await asyncio.to_thread(request, url)


async def dead_job(pool: asyncpg.Pool, task: str) -> int:
    job = await JobStore(pool).enqueue(task, delay=3600)
    await pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', finished_at = now(), "
        "last_error = 'ValueError: boom' WHERE id = $1",
        job.id,
    )
    return job.id


async def test_pages_of_shard_b_show_b_rows_and_links_keep_the_shard(shards: Shards) -> None:
    url = shards.served.url
    on_a = await JobStore(shards.a).enqueue("only.on.a", delay=3600)
    on_b = await JobStore(shards.b).enqueue("only.on.b", delay=3600)
    assert on_a.id == on_b.id  # the first job of each fresh shard: one id, two jobs
    name = f"nightly-{uuid.uuid4().hex[:6]}"
    await ScheduleStore(shards.a).add(ScheduleSpec(name=name, task="sched.a", cron="0 3 * * *"))
    await ScheduleStore(shards.b).add(ScheduleSpec(name=name, task="sched.b", cron="0 3 * * *"))

    status, body = await get(f"{url}/jobs?shard=b")
    assert status == 200 and "only.on.b" in body and "only.on.a" not in body
    assert f'href="/jobs/{on_b.id}?shard=b"' in body
    status, body = await get(f"{url}/jobs")  # no shard: the first one, a
    assert status == 200 and "only.on.a" in body and "only.on.b" not in body
    assert f'href="/jobs/{on_a.id}?shard=a"' in body

    status, body = await get(f"{url}/jobs/{on_b.id}?shard=b")
    assert status == 200 and "only.on.b" in body and "only.on.a" not in body
    status, body = await get(f"{url}/jobs/{on_a.id}?shard=a")
    assert status == 200 and "only.on.a" in body

    quoted = urllib.parse.quote(name, safe="")
    status, body = await get(f"{url}/schedules?shard=b")
    assert status == 200 and f'href="/schedules/{quoted}?shard=b"' in body
    status, body = await get(f"{url}/schedules/{quoted}?shard=b")
    assert status == 200 and "sched.b" in body and "sched.a" not in body
    assert '<input type="hidden" name="shard" value="b">' in body  # its forms post to b

    status, body = await get(f"{url}/?shard=b")
    assert status == 200
    assert 'data-shard="a"' in body and 'data-shard="b"' in body
    status, body = await get(f"{url}/healthz")
    assert json.loads(body)["shards"] == {"a": "up", "b": "up"}


async def test_actions_on_shard_b_change_b_rows_only(shards: Shards, page: Any) -> None:
    url = shards.served.url
    task = f"twin.{uuid.uuid4().hex[:6]}"
    a_id, b_id = await dead_job(shards.a, task), await dead_job(shards.b, task)
    assert a_id == b_id  # the same count of jobs on both shards so far

    await page.goto(f"{url}/jobs/{b_id}?shard=b")
    await page.get_by_role("button", name="Retry").click()
    await expect(page).to_have_url(f"{url}/jobs/{b_id}?shard=b")
    await expect(page.locator(".flash")).to_contain_text(f"job {b_id} is now pending")
    assert (await JobStore(shards.b).get(b_id)).status == "pending"
    assert (await JobStore(shards.a).get(a_id)).status == "dead"

    name = f"hourly-{uuid.uuid4().hex[:6]}"
    for pool in (shards.a, shards.b):
        await ScheduleStore(pool).add(ScheduleSpec(name=name, task="sched.x", cron="0 * * * *"))
    await page.goto(f"{url}/schedules/{urllib.parse.quote(name, safe='')}?shard=b")
    await page.get_by_role("button", name="Pause").click()
    await expect(page.get_by_test_id("schedule-state")).to_have_text("paused")
    await expect(page).to_have_url(re.compile(r"\?shard=b$"))
    assert (await ScheduleStore(shards.b).get(name)).paused
    assert not (await ScheduleStore(shards.a).get(name)).paused

    bulk = f"bulk.{uuid.uuid4().hex[:6]}"
    later = datetime.now(UTC) + timedelta(hours=3)
    for pool, count in ((shards.a, 2), (shards.b, 3)):
        specs = [JobSpec(task=bulk, payload={}, due_at=later) for _ in range(count)]
        await JobStore(pool).bulk_enqueue(specs)
    await page.goto(f"{url}/jobs?status=pending&task={bulk}&shard=b")
    await expect(page.locator("table[data-testid=jobs] tbody tr")).to_have_count(3)
    await page.get_by_role("link", name="Cancel all matching pending…").click()
    await expect(page.get_by_test_id("bulk-count")).to_have_text("3")
    await page.get_by_role("button", name="Yes, cancel 3 job(s)").click()
    await expect(page.locator(".flash")).to_contain_text("cancel: 3 of 3 previewed job(s) changed")
    await expect(page).to_have_url(re.compile(r"/jobs\?.*shard=b"))
    for pool, expected in ((shards.a, {"pending": 2}), (shards.b, {"cancelled": 3})):
        rows = await pool.fetch(
            "SELECT status, count(*) AS n FROM duetime.jobs WHERE task = $1 GROUP BY status", bulk
        )
        assert {r["status"]: r["n"] for r in rows} == expected


async def test_an_unknown_shard_is_404_for_pages_and_actions(shards: Shards, page: Any) -> None:
    url = shards.served.url
    job_id = await dead_job(shards.a, "unknown.shard")
    for path in (
        "/jobs?shard=nope",
        f"/jobs/{job_id}?shard=nope",
        "/?shard=nope",
        "/cluster?shard=nope",
    ):
        status, body = await get(url + path)
        assert status == 404, path
        assert "no shard named &#39;nope&#39;: this dashboard serves a, b" in body, path

    await page.goto(f"{url}/jobs/{job_id}")  # a real form's CSRF token and cookie
    csrf = await page.locator("input[name=csrf]").first.input_value()
    in_query = await page.request.post(f"{url}/jobs/{job_id}/retry?shard=nope", form={"csrf": csrf})
    in_form = await page.request.post(
        f"{url}/jobs/{job_id}/retry", form={"csrf": csrf, "shard": "nope"}
    )
    assert (in_query.status, in_form.status) == (404, 404)
    assert (await JobStore(shards.a).get(job_id)).status == "dead"
    forged = await page.request.post(f"{url}/jobs/{job_id}/retry?shard=a", form={})
    assert forged.status == 403  # CSRF is checked whatever the shard


async def test_the_picker_switches_shard_and_navigation_keeps_it(
    shards: Shards, dashboard: Served, page: Any
) -> None:
    url = shards.served.url
    task = f"picked.{uuid.uuid4().hex[:6]}"
    job = await JobStore(shards.b).enqueue(task, delay=3600)
    await page.goto(f"{url}/jobs?task={task}")
    picker = page.locator("select[name=shard]")
    await expect(picker).to_have_value("a")
    await expect(page.get_by_text("No job matches these filters.")).to_be_visible()

    await picker.select_option("b")
    await expect(page).to_have_url(f"{url}/jobs?shard=b")
    await expect(picker).to_have_value("b")
    await page.click(f'tr[data-job="{job.id}"] a')
    await expect(page).to_have_url(f"{url}/jobs/{job.id}?shard=b")
    await expect(page.get_by_test_id("job-task")).to_have_text(task)
    await page.get_by_role("link", name="Schedules").click()
    await expect(page).to_have_url(f"{url}/schedules?shard=b")
    await page.get_by_role("link", name="Overview").click()
    await expect(page.get_by_test_id("current-shard")).to_have_text("b")
    await expect(page.locator("tr[data-shard=b]")).to_have_class("current")

    await page.goto(dashboard.url + "/jobs")  # unsharded: no picker, links as before
    await expect(page.locator("select[name=shard]")).to_have_count(0)
    assert "?shard=" not in await page.content()
    _, body = await get(dashboard.url + "/healthz")
    assert "shards" not in json.loads(body)


async def test_a_shard_that_is_down_is_a_row_and_the_others_still_serve(
    cluster: Cluster, shards: Shards
) -> None:
    down = f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere"
    served = await cluster.start_dashboard(
        env={"DUETIME_SHARDS": f"{shards.env},down={down}", "DUETIME_DB_TIMEOUT": "1"}
    )
    try:
        status, body = await get(f"{served.url}/?shard=a")
        assert status == 200
        row = re.search(r'<tr data-shard="down".*?</tr>', body, re.S)
        assert row is not None and 'data-testid="reachable" class="bad">no<' in row.group(0)
        status, body = await get(f"{served.url}/?shard=down")  # the table stays, and says why
        assert status == 200 and "PostgreSQL unavailable on shard down" in body
        status, body = await get(f"{served.url}/jobs?shard=down")
        assert status == 503 and "PostgreSQL unavailable" in body
        status, _ = await get(f"{served.url}/jobs?shard=b")
        assert status == 200
        health = json.loads((await get(f"{served.url}/healthz"))[1])
        assert health["database"] == "down"
        assert health["shards"] == {"a": "up", "b": "up", "down": "down"}
    finally:
        await served.process.stop(timeout=10)


async def test_overview_shows_each_shard_leader_and_epoch(
    cluster: Cluster, shards: Shards, procs: Processes, page: Any
) -> None:
    """Last in this module: the scheduler it starts would dispatch the other tests' jobs."""
    node = f"shard-leader-{uuid.uuid4().hex[:4]}"
    replica = procs.spawn(
        duetime_argv("scheduler"),
        name="sharded-scheduler",
        env={**cluster.env, "DUETIME_SHARDS": shards.env, "DUETIME_NODE_ID": node},
    )

    async def epochs() -> dict[str, int] | None:
        if not replica.running():
            raise AssertionError(f"scheduler exited:\n{replica.tail()}")
        found = {
            name: int(await pool.fetchval("SELECT epoch FROM duetime.leader_fence"))
            for name, pool in (("a", shards.a), ("b", shards.b))
        }
        return found if all(found.values()) else None

    fenced = await wait_for(epochs, timeout=40, message="the replica fenced both shards")
    assert fenced is not None
    await page.goto(shards.served.url + "/")
    for name, epoch in fenced.items():
        row = page.locator(f"tr[data-shard={name}]")
        await expect(row.get_by_test_id("leader")).to_have_text(node)
        await expect(row.get_by_test_id("epoch")).to_have_text(str(epoch))
        await expect(row.get_by_test_id("reachable")).to_have_text("yes")
    await page.goto(shards.served.url + "/cluster?shard=b")
    await expect(page.get_by_test_id("cluster-shard")).to_have_text("b")
    await expect(page.get_by_test_id("etcd-leader")).to_have_text(node)
    await expect(page.get_by_test_id("fence-epoch")).to_have_text(str(fenced["b"]))
    await expect(page.get_by_test_id("members")).to_contain_text(node)
