"""Tags, meta and progress on the dashboard (DESIGN §9, §12), through the real ASGI
application: the job list filters by tags and shows each job's tags and progress, the
job page shows tags and meta, and a bulk cancel by tag (preview, then a POST with the
CSRF token) cancels the tag's pending and running jobs, recording who."""

from __future__ import annotations

import html
import re

import asyncpg
import pytest

from scheduler.config import Settings
from scheduler.store.jobs import JobStore
from tests.dashboard.test_security import call, csrf_of, running
from tests.fixtures_tasks.jobs import FENCE_EPOCH

pytestmark = pytest.mark.timeout(60)
COOKIE = {"Cookie": "duetime_csrf=k"}


async def test_job_list_filters_by_tag_and_a_bulk_cancel_takes_running_jobs(
    settings: Settings, db_pool: asyncpg.Pool, unique: str
) -> None:
    tag = f"dash:{unique}"
    store = JobStore(db_pool)
    pending = await store.enqueue(
        "dash.tags", delay=3600, tags=[tag, "nightly"], meta={"asked_by": "<b>ada</b>"}
    )
    running_id = await db_pool.fetchval(
        "INSERT INTO duetime.jobs (task, queue, status, dispatch_epoch, dispatched_at, tags, "
        f"progress, progress_note, progress_at) VALUES ('dash.tags', 'dash-tags', 'dispatched', "
        f"{FENCE_EPOCH}, now(), ARRAY[$1], 0.25, 'a quarter', now()) RETURNING id",
        tag,
    )
    other = await store.enqueue("dash.tags", delay=3600, tags=["elsewhere"])
    async with running(settings, token=None) as app:
        status, _, page = await call(app, "GET", f"/jobs?tags={tag}", headers=COOKIE)
        assert status == 200
        page = html.unescape(page)
        shown = set(map(int, re.findall(r'<tr data-job="(\d+)"', page)))
        assert shown == {pending.id, running_id}
        assert f'value="{tag}" size="14" data-testid="tags-filter"' in page
        row = page.split(f'<tr data-job="{running_id}">', 1)[1].split("</tr>", 1)[0]
        assert "25% <span" in row and "a quarter" in row and f">{tag}</a>" in row
        assert "Cancel all matching pending or running…" in page

        status, _, page = await call(app, "GET", f"/jobs/{pending.id}", headers=COOKIE)
        tags = page.split('data-testid="job-tags">', 1)[1].split("</dd>", 1)[0]
        assert f">{tag}</a>" in html.unescape(tags) and ">nightly</a>" in tags
        meta = page.split('data-testid="job-meta">', 1)[1].split("</pre>", 1)[0]
        assert "&lt;b&gt;ada&lt;/b&gt;" in meta  # escaped, not markup

        status, _, page = await call(
            app, "GET", f"/jobs/bulk?action=cancel&tags={tag}", headers=COOKIE
        )
        assert 'data-testid="bulk-count">2<' in page
        assert "pending or running (their handlers are stopped)" in page
        form = dict(re.findall(r'<input type="hidden" name="([a-z_]+)" value="([^"]*)"', page))
        form["csrf"] = csrf_of(page)
        status, _, _ = await call(
            app, "POST", "/jobs/bulk",
            headers={**COOKIE, "Origin": "http://127.0.0.1:8089"},
            form={k: html.unescape(v) for k, v in form.items()},
        )  # fmt: skip
        assert status == 303
    rows = await db_pool.fetch(
        "SELECT id, status, cancelled_by FROM duetime.jobs WHERE id = ANY($1::bigint[])",
        [pending.id, running_id, other.id],
    )
    assert {r["id"]: (r["status"], r["cancelled_by"]) for r in rows} == {
        pending.id: ("cancelled", "dashboard:127.0.0.1"),
        running_id: ("cancelled", "dashboard:127.0.0.1"),
        other.id: ("pending", None),
    }
