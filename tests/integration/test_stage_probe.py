"""The staging probe (``next_stage_in``): the time until the earliest job staging could
take, read by walking the pending jobs in run-time order and stopping at the first one,
however many are scheduled further ahead (docs/benchmarks.md, "The staging probe sorted
every job ahead")."""

from __future__ import annotations

import asyncpg
import pytest

from scheduler import db
from scheduler.store.dispatch import staging_sql
from tests.support.helpers import job_rows_read

PROBE = staging_sql("next_stage_in")


async def _schedule(conn: asyncpg.Connection, task: str, queue: str, at_s: float, n: int) -> None:
    await conn.execute(
        "INSERT INTO duetime.jobs (task, payload, queue, due_at) SELECT $1, '{}', $2,"
        " now() + make_interval(secs => $3) + g * interval '1 ms' FROM generate_series(1, $4) g",
        task,
        queue,
        at_s,
        n,
    )


@pytest.fixture
async def conn(migrated_dsn: str) -> asyncpg.Connection:
    conn = await db.connect(migrated_dsn)
    await conn.execute("INSERT INTO duetime.queues (name) VALUES ('q'), ('paused')")
    await conn.execute("UPDATE duetime.queues SET paused = true WHERE name = 'paused'")
    yield conn
    await conn.close()


async def test_the_probe_reads_the_first_job_not_every_job_ahead(conn: asyncpg.Connection) -> None:
    """40,000 jobs scheduled ahead: the probe answers from the first of them. The old
    text planned a sort of every pending job ahead once there were some 30,000 (all of
    them read, 25 ms per probe at 30,000), because its EXISTS over duetime.limits became
    an anti-join the planner expected to pass almost nothing."""
    await _schedule(conn, "t.probe", "q", 600, 40_000)
    async with conn.transaction():
        seconds = await conn.fetchval(PROBE)
        read = await job_rows_read(conn)
    assert 590 < seconds <= 641
    assert read <= 10, f"the probe read {read} job rows"


async def test_the_probe_still_skips_what_staging_would_not_take(
    conn: asyncpg.Connection,
) -> None:
    """Earliest first: a job of a limited task, one of a paused queue, one with a unique
    key; then a job staging takes. The probe names the last one's time, as before."""
    await _schedule(conn, "t.limited", "q", 100, 3)
    await conn.execute(
        "INSERT INTO duetime.limits (target, max_running) VALUES ('task:t.limited', 1)"
    )
    await _schedule(conn, "t.open", "paused", 200, 3)
    await conn.execute(
        "INSERT INTO duetime.jobs (task, payload, queue, due_at, unique_key)"
        " VALUES ('t.unique', '{}', 'q', now() + interval '300 s', 'u1')"
    )
    await _schedule(conn, "t.open", "q", 400, 3)
    seconds = await conn.fetchval(PROBE)
    assert 390 < seconds <= 401
    await conn.execute("DELETE FROM duetime.limits")
    assert 90 < await conn.fetchval(PROBE) <= 101
