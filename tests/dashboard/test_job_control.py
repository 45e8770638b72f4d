"""The job page and job control (DESIGN §12), through the real ASGI application: the
result of a succeeded job is shown, a running (dispatched) job has a Cancel button that
cancels it and records who, a finished job has none."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from scheduler.config import Settings
from tests.dashboard.test_security import call, csrf_of, running
from tests.fixtures_tasks.jobs import FENCE_EPOCH

pytestmark = pytest.mark.timeout(60)


async def _job(pool: asyncpg.Pool, status: str, result: Any = None) -> int:
    return int(
        await pool.fetchval(
            "INSERT INTO duetime.jobs (task, queue, status, dispatch_epoch, result, "
            f"dispatched_at) VALUES ('dash.jc', 'dash-jc', $1, {FENCE_EPOCH}, $2::jsonb, "
            "now()) RETURNING id",
            status,
            result,
        )
    )


async def test_the_job_page_shows_the_result_and_cancels_a_running_job(
    settings: Settings, db_pool: asyncpg.Pool
) -> None:
    done = await _job(db_pool, "succeeded", {"rows": 7})
    busy = await _job(db_pool, "dispatched")
    await db_pool.execute(
        "UPDATE duetime.jobs SET progress = 0.4, progress_note = 'copied 4 of 10', "
        "progress_at = now() WHERE id = $1",
        busy,
    )
    cookie = {"Cookie": "duetime_csrf=k"}
    async with running(settings, token=None) as app:
        status, _, page = await call(app, "GET", f"/jobs/{done}", headers=cookie)
        assert status == 200
        shown = page.split('data-testid="job-result">', 1)[1].split("</pre>", 1)[0]
        assert shown.replace("&#34;", '"').split() == ["{", '"rows":', "7", "}"]
        assert f'action="/jobs/{done}/cancel"' not in page
        status, _, page = await call(app, "GET", f"/jobs/{busy}", headers=cookie)
        assert f'action="/jobs/{busy}/cancel"' in page
        progress = page.split('data-testid="job-progress">', 1)[1].split("</dd>", 1)[0]
        assert progress.startswith("40% (copied 4 of 10), "), progress
        status, _, _ = await call(
            app, "POST", f"/jobs/{busy}/cancel",
            headers={**cookie, "Origin": "http://127.0.0.1:8089"},
            form={"csrf": csrf_of(page)},
        )  # fmt: skip
        assert status == 303
    row = await db_pool.fetchrow(
        "SELECT status, cancelled_by FROM duetime.jobs WHERE id = $1", busy
    )
    assert (row["status"], row["cancelled_by"]) == ("cancelled", "dashboard:127.0.0.1")
