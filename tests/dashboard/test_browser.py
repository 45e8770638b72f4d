"""The dashboard in a real browser (Debian's chromium via Playwright) against a real
cluster: PostgreSQL, a scheduler replica, a worker, RabbitMQ, etcd.

Rows are set up through the stores (``JobStore``, ``ScheduleStore``); the only direct
SQL turns a job dead, a state only a failing worker reaches otherwise. Every check
reads the database as well as the page, so a page that shows the wrong thing fails.
"""

from __future__ import annotations

import re
import urllib.parse
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from playwright.async_api import expect

from scheduler.jobspec import JobSpec
from scheduler.planning import ScheduleSpec
from scheduler.store import JobStore, ScheduleStore
from scheduler.workflow import chord, step
from tests.dashboard.conftest import Cluster, Served
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)


async def make_dead(cluster: Cluster, task: str, payload: dict[str, Any], **kw: Any) -> int:
    error = kw.pop("error", "ValueError: boom")
    job = await JobStore(cluster.pool).enqueue(task, payload, delay=3600, **kw)
    await cluster.pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', finished_at = now(), last_error = $2 "
        "WHERE id = $1",
        job.id,
        error,
    )
    return job.id


async def test_overview_shows_the_counts_in_the_database(
    cluster: Cluster, dashboard: Served, page: Any
) -> None:
    store = JobStore(cluster.pool)
    later = datetime.now(UTC) + timedelta(hours=2)
    await store.bulk_enqueue(
        [JobSpec(task="count.me", payload={}, due_at=later, queue="counts") for _ in range(7)]
    )
    cancelled = await store.enqueue("count.me", delay=3600, queue="counts")
    await store.cancel(cancelled.id)
    await make_dead(cluster, "count.me", {}, queue="counts")
    counts = await store.counts_by_status()

    await page.goto(dashboard.url + "/")
    for status in ("pending", "dispatched", "succeeded", "dead", "cancelled"):
        await expect(page.get_by_test_id(f"total-{status}")).to_have_text(str(counts[status]))
    row = page.locator('tr[data-queue="counts"] td')
    await expect(row.nth(1)).to_have_text("7")  # pending
    await expect(row.nth(5)).to_have_text("1")  # dead
    await expect(row.nth(6)).to_have_text("1")  # cancelled
    # the page polls through htmx; a new pending job shows up without a reload
    await store.enqueue("count.me", delay=3600, queue="counts")
    await expect(row.nth(1)).to_have_text("8", timeout=15_000)


async def test_overview_polling_pauses_while_the_tab_is_hidden(
    dashboard: Served, page: Any
) -> None:
    await page.goto(dashboard.url + "/")
    await page.wait_for_function("window.htmx !== undefined")
    sent = await page.evaluate(
        """() => {
            window.__sent = 0;
            document.addEventListener("htmx:beforeSend", () => { window.__sent += 1; });
            Object.defineProperty(document, "hidden", {configurable: true, get: () => true});
            htmx.trigger("#overview", "visible-again");  // a refresh asked for while hidden
            return window.__sent;
        }"""
    )
    assert sent == 0  # dashboard.js cancelled it (htmx sends synchronously otherwise)
    await page.evaluate(
        """() => {
            Object.defineProperty(document, "hidden", {configurable: true, get: () => false});
            document.dispatchEvent(new Event("visibilitychange"));
        }"""
    )
    await page.wait_for_function("window.__sent >= 1")  # shown again: refreshed at once


async def test_filter_dead_open_retry_and_see_it_succeed(
    workers_running: Cluster, dashboard: Served, page: Any
) -> None:
    cluster = workers_running
    tag = uuid.uuid4().hex[:8]
    job = await JobStore(cluster.pool).enqueue(
        "fixtures.record", {"tag": tag}, queue=cluster.queue, delay=0
    )
    # wait for the real run, then kill it off as a failing worker would have
    await wait_for(lambda: _status(cluster, job.id, "succeeded"), timeout=30, message="first run")
    await cluster.pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', last_error = 'RuntimeError: flaky' WHERE id = $1",
        job.id,
    )
    await cluster.pool.execute("DELETE FROM duetime.job_ledger WHERE job_id = $1", job.id)

    await page.goto(dashboard.url + "/jobs")
    await page.select_option("select[name=status]", "dead")
    await page.click("form.filters button[type=submit]")
    await expect(page).to_have_url(re.compile(r"status=dead"))
    await page.click(f'tr[data-job="{job.id}"] a')
    await expect(page.get_by_test_id("job-status")).to_have_text("dead")
    await page.get_by_role("button", name="Retry").click()
    await expect(page.locator(".flash")).to_contain_text(f"job {job.id} is now pending")

    await wait_for(lambda: _status(cluster, job.id, "succeeded"), timeout=30, message="retry")
    await page.reload()
    await expect(page.get_by_test_id("job-status")).to_have_text("succeeded")
    await expect(page.get_by_text("w1", exact=True)).to_be_visible()  # the ledger's worker


async def _status(cluster: Cluster, job_id: int, status: str) -> bool:
    return (await JobStore(cluster.pool).get(job_id)).status == status


async def test_pause_a_schedule_and_its_planned_fires_disappear(
    workers_running: Cluster, dashboard: Served, page: Any
) -> None:
    cluster = workers_running
    name = f"every-minute-{uuid.uuid4().hex[:6]}"
    store = ScheduleStore(cluster.pool)
    schedule = await store.add(
        ScheduleSpec(name=name, task="fixtures.record", interval=timedelta(seconds=5),
                     queue=cluster.queue)
    )  # fmt: skip

    async def planned() -> int:
        return int(
            await cluster.pool.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE schedule_id = $1 "
                "AND status = 'pending' AND due_at > now() + interval '1 second'",
                schedule.id,
            )
        )

    await wait_for(planned, timeout=30, message="the planner materialized fires ahead")
    await page.goto(dashboard.url + "/schedules")
    await page.get_by_role("link", name=name).click()
    await expect(page.get_by_test_id("upcoming").locator("tbody tr")).to_have_count(10)
    await expect(page.get_by_test_id("planned").locator("tr").first).to_be_visible()

    await page.get_by_role("button", name="Pause").click()
    await expect(page.locator(".flash")).to_contain_text(f"paused {name}")
    await expect(page.get_by_test_id("schedule-state")).to_have_text("paused")
    await expect(page.get_by_test_id("no-upcoming")).to_be_visible()
    await expect(page.get_by_test_id("no-planned")).to_be_visible()
    assert await planned() == 0
    assert (await store.get(name)).paused


async def test_bulk_cancel_by_filter_previews_then_cancels_only_the_matches(
    cluster: Cluster, dashboard: Served, page: Any
) -> None:
    task = f"bulk.{uuid.uuid4().hex[:6]}"
    store = JobStore(cluster.pool)
    later = datetime.now(UTC) + timedelta(hours=3)
    await store.bulk_enqueue([JobSpec(task=task, payload={}, due_at=later) for _ in range(5)])
    other = await store.enqueue(task + "-other", delay=3600)

    await page.goto(f"{dashboard.url}/jobs?status=pending&task={task}")
    await expect(page.locator("table[data-testid=jobs] tbody tr")).to_have_count(5)
    await page.get_by_role("link", name="Cancel all matching pending…").click()
    await expect(page.get_by_test_id("bulk-count")).to_have_text("5")
    # a job that arrives after the preview is not part of what was confirmed
    late = await store.enqueue(task, delay=3600)
    await page.get_by_role("button", name="Yes, cancel 5 job(s)").click()
    await expect(page.locator(".flash")).to_contain_text("cancel: 5 of 5 previewed job(s) changed")

    rows = await cluster.pool.fetch(
        "SELECT status, count(*) AS n FROM duetime.jobs WHERE task = $1 GROUP BY status", task
    )
    assert {r["status"]: r["n"] for r in rows} == {"cancelled": 5, "pending": 1}
    assert (await store.get(late.id)).status == "pending"
    assert (await store.get(other.id)).status == "pending"


async def test_read_only_shows_no_action_and_refuses_posts(cluster: Cluster, page: Any) -> None:
    served = await cluster.start_dashboard("--read-only")
    job_id = await make_dead(cluster, "ro.task", {})
    await page.goto(f"{served.url}/jobs/{job_id}")
    await expect(page.get_by_test_id("job-status")).to_have_text("dead")
    await expect(page.get_by_test_id("read-only")).to_be_visible()
    assert await page.locator("main button").count() == 0
    await page.goto(f"{served.url}/jobs?status=dead")
    assert await page.locator("main a.button").count() == 0  # no bulk links
    response = await page.request.post(f"{served.url}/jobs/{job_id}/retry", form={})
    assert response.status == 403
    assert (await JobStore(cluster.pool).get(job_id)).status == "dead"


async def test_forged_post_without_csrf_token_is_refused(
    cluster: Cluster, dashboard: Served, page: Any
) -> None:
    job_id = await make_dead(cluster, "csrf.task", {})
    await page.goto(f"{dashboard.url}/jobs/{job_id}")  # the browser holds the csrf cookie
    forged = await page.request.post(f"{dashboard.url}/jobs/{job_id}/retry", form={})
    assert forged.status == 403
    wrong = await page.request.post(f"{dashboard.url}/jobs/{job_id}/retry", form={"csrf": "0" * 64})
    assert wrong.status == 403
    cross = await page.request.post(
        f"{dashboard.url}/jobs/{job_id}/retry",
        form={"csrf": await page.locator("input[name=csrf]").first.input_value()},
        headers={"Origin": "http://evil.example"},
    )
    assert cross.status == 403
    assert (await JobStore(cluster.pool).get(job_id)).status == "dead"
    await page.get_by_role("button", name="Retry").click()  # the page's own form works
    await expect(page.locator(".flash")).to_contain_text("is now pending")


async def test_script_in_payload_task_and_error_is_shown_as_text(
    cluster: Cluster, dashboard: Served, page: Any
) -> None:
    evil = "<script>window.__pwned = 1</script><img src=x onerror='window.__pwned = 2'>"
    job_id = await make_dead(cluster, "<b>task</b>" + evil, {"html": evil}, error=evil)
    name = f"{evil}/{uuid.uuid4().hex[:4]}"
    await ScheduleStore(cluster.pool).add(
        ScheduleSpec(name=name, task=evil, cron="0 3 * * *", payload={"x": evil}, paused=True)
    )
    schedule_path = "/schedules/" + urllib.parse.quote(name, safe="")
    for path in (f"/jobs/{job_id}", "/jobs?status=dead", "/", "/schedules", schedule_path):
        await page.goto(dashboard.url + path)
        assert await page.evaluate("window.__pwned") is None, path
        assert await page.locator("main script, main img").count() == 0, path
    await page.goto(f"{dashboard.url}/jobs/{job_id}")
    await expect(page.get_by_test_id("job-payload")).to_contain_text("<script>window.__pwned")
    await expect(page.get_by_test_id("job-task")).to_have_text("<b>task</b>" + evil)
    await expect(page.get_by_test_id("job-error")).to_have_text(evil)
    await page.goto(dashboard.url + schedule_path)
    await expect(page.get_by_test_id("schedule-name")).to_have_text(name)


async def test_a_workflow_page_shows_each_job_its_edges_and_cancels_it(
    cluster: Cluster, dashboard: Served, page: Any
) -> None:
    task = f"wf.{uuid.uuid4().hex[:6]}"
    run = await JobStore(cluster.pool).enqueue_workflow(
        chord([step(task, delay=3600), step(task, delay=3600)], step(task + "-cb"))
    )
    first, second, callback = run.ids
    await page.goto(f"{dashboard.url}/workflows/{run.workflow_id}")
    await expect(page.locator("table[data-testid=workflow-jobs] tbody tr")).to_have_count(3)
    await expect(page.get_by_test_id(f"workflow-edges-{callback}")).to_have_text(
        f"{first}, {second}"
    )
    await (
        page.get_by_test_id(f"workflow-edges-{callback}")
        .get_by_role("link", name=str(first))
        .click()
    )
    await expect(page.get_by_test_id("job-workflow")).to_have_text(str(run.workflow_id))
    await page.get_by_test_id("job-workflow").get_by_role("link").click()
    await page.get_by_test_id("workflow-cancel").click()
    await expect(page.locator(".flash")).to_contain_text("3 unfinished job(s) of workflow")
    await expect(page.get_by_test_id("workflow-summary")).to_contain_text("3 cancelled")
    rows = await cluster.pool.fetch("SELECT status FROM duetime.jobs WHERE id = ANY($1)", run.ids)
    assert {r["status"] for r in rows} == {"cancelled"}
