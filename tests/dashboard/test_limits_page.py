"""The dashboard's Limits page and the limit key on the job page, in process (no
browser): the ASGI app against a real database with limits, dispatched jobs, due jobs
and logged starts, answering one GET at a time as uvicorn would."""

from __future__ import annotations

import asyncio
import dataclasses
import html
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from scheduler import db
from scheduler.config import Settings
from scheduler.dashboard import Dashboard, create_app
from scheduler.dashboard.auth import Auth
from scheduler.store.fence import FenceStore
from scheduler.store.limits import LimitStore
from tests.support.helpers import declare_queues

pytestmark = pytest.mark.timeout(60)


async def get(app: Any, path: str) -> tuple[int, str]:
    """One GET through the ASGI app; (status, body)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"127.0.0.1:8089"), (b"accept", b"text/html")],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8089),
    }  # fmt: skip
    sent: list[dict[str, Any]] = []
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], html.unescape(body.decode())


@pytest.fixture
async def served(migrated_dsn: str, settings: Settings) -> AsyncIterator[tuple[Any, asyncpg.Pool]]:
    pool = await db.create_pool(migrated_dsn, max_size=2)
    dash = Dashboard(dataclasses.replace(settings, database_url=migrated_dsn), Auth.create(None))
    await dash.open()
    try:
        yield create_app(dash), pool
    finally:
        await dash.close()
        await pool.close()


def row_of(body: str, target: str) -> str:
    start = body.index(f'data-target="{target}"')
    return body[start : body.index("</tr>", start)]


async def test_limits_page_shows_each_limit_its_use_and_the_busiest_keys(
    served: tuple[Any, asyncpg.Pool],
) -> None:
    app, pool = served
    status, body = await get(app, "/limits")
    assert status == 200 and "No limits." in body
    await declare_queues(pool, "lim")
    assert await FenceStore(pool).advance(1, "test-node")  # the rows below are dispatched
    store = LimitStore(pool)
    await store.set("task:mail", 2)
    await store.set("queue:lim", 1, per_key=True, rate="10/s")
    await pool.execute(
        "INSERT INTO duetime.jobs (task, queue, limit_key, status, dispatched_at,"
        " dispatch_epoch) VALUES ('mail', 'default', NULL, 'dispatched', now(), 1),"
        " ('mail', 'default', NULL, 'dispatched', now(), 1),"
        " ('api', 'lim', 'tenant-a', 'dispatched', now(), 1)"
    )
    await pool.execute(
        "INSERT INTO duetime.jobs (task, queue, limit_key, due_at)"
        " SELECT 'mail', 'default', NULL, now() - interval '1 minute'"
        "   FROM generate_series(1, 7)"
        " UNION ALL SELECT 'api', 'lim', 'tenant-b', now() - interval '1 minute'"
        "   FROM generate_series(1, 3)"
    )
    await pool.execute(
        "INSERT INTO duetime.limit_starts (target, limit_key, started_at, starts)"
        " VALUES ('queue:lim', 'tenant-a', now() + interval '1 minute', 4)"
    )
    status, body = await get(app, "/limits")
    assert status == 200
    mail = row_of(body, "task:mail")
    assert '<td class="n" data-testid="limit-running">2</td>' in mail
    assert '<td class="n" data-testid="limit-due">7</td>' in mail
    assert "limit task:mail holds 7 due jobs: 2 of 2 running" in body
    per_key = row_of(body, "queue:lim")
    assert "10/s" in per_key and "yes" in per_key
    assert '<td class="n" data-testid="limit-started">4</td>' in per_key  # busiest key's
    assert '<code>tenant-a</code></td><td class="n">1</td><td class="n">4</td>' in body
    assert '<code>tenant-b</code></td><td class="n">0</td><td class="n">0</td>' in body
    assert 'href="/limits" aria-current="page"' in body


async def test_job_page_shows_limit_key_priority_and_unique_key(
    served: tuple[Any, asyncpg.Pool],
) -> None:
    app, pool = served
    job_id = await pool.fetchval(
        "INSERT INTO duetime.jobs (task, limit_key, priority, due_at)"
        " VALUES ('api', 'tenant-<7>', 9, now() + interval '1 hour') RETURNING id"
    )
    status, body = await get(app, f"/jobs/{job_id}")
    assert status == 200
    assert '<dd data-testid="job-limit-key"><code>tenant-<7></code></dd>' in body
    assert '<dd data-testid="job-priority">9</dd>' in body
    assert '<dd data-testid="job-unique-key">-</dd>' in body
