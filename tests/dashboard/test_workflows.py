"""The dashboard's workflow page (migration 0025): each job, its state, its edges, and a
button that cancels the whole workflow; the job page links to its workflow."""

from __future__ import annotations

import asyncpg
import pytest

from scheduler.config import Settings
from scheduler.store.jobs import JobStore
from scheduler.workflow import chord, step
from tests.dashboard.test_security import call, csrf_of, running

pytestmark = pytest.mark.timeout(60)


async def test_the_workflow_page_shows_edges_and_cancels_the_workflow(
    settings: Settings, db_pool: asyncpg.Pool
) -> None:
    run = await JobStore(db_pool).enqueue_workflow(
        chord([step("dash.m", delay=3600), step("dash.m", delay=3600)], step("dash.cb"))
    )
    first, second, callback = run.ids
    cookie = {"Cookie": "duetime_csrf=k"}
    async with running(settings, token=None) as app:
        status, _, page = await call(app, "GET", f"/workflows/{run.workflow_id}", headers=cookie)
        assert status == 200
        assert "3 job(s)" in page and "2 pending" in page and "1 waiting" in page
        edges = page.split(f'data-testid="workflow-edges-{callback}">', 1)[1].split("</td>")[0]
        assert f'href="/jobs/{first}"' in edges and f'href="/jobs/{second}"' in edges
        status, _, job_page = await call(app, "GET", f"/jobs/{callback}", headers=cookie)
        assert f'href="/workflows/{run.workflow_id}"' in job_page
        status, _, _ = await call(
            app, "POST", f"/workflows/{run.workflow_id}/cancel",
            headers={**cookie, "Origin": "http://127.0.0.1:8089"},
            form={"csrf": csrf_of(page)},
        )  # fmt: skip
        assert status == 303
        status, _, page = await call(app, "GET", f"/workflows/{run.workflow_id}", headers=cookie)
        assert "3 cancelled" in page and 'data-testid="workflow-cancel"' not in page
        status, _, page = await call(app, "GET", "/workflows/987654321", headers=cookie)
        assert status == 404 and "no workflow 987654321" in page
    got = await db_pool.fetch(
        "SELECT status, cancelled_by FROM duetime.jobs WHERE id = ANY($1)", run.ids
    )
    assert {(r["status"], r["cancelled_by"]) for r in got} == {("cancelled", "dashboard:127.0.0.1")}
