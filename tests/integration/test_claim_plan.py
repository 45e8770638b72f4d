"""The dispatcher's due claim reads the jobs it takes in index order and stops there,
also on a bucket whose statistics still describe it as nearly empty (a bulk INSERT that
autovacuum has not analysed yet): the plan is made once per connection, and made from
such statistics it sorted every due row for each batch (docs/benchmarks.md, "The due
claim on a bucket not yet analysed")."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from scheduler import db
from scheduler.store.dispatch import DispatchStore
from tests.support.helpers import job_rows_read


@pytest.fixture
async def pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(migrated_dsn, max_size=2)
    await pool.execute("INSERT INTO duetime.queues (name) VALUES ('q')")
    yield pool
    await pool.close()


async def test_the_claim_takes_a_batch_without_reading_every_due_job(pool: asyncpg.Pool) -> None:
    """40,000 due jobs, never analysed; a batch of 500 reads about 500 rows (40,000 and
    a sort before), takes them in priority then run-time order, and leaves the
    transaction's planner settings as they were."""
    await pool.execute(
        "INSERT INTO duetime.jobs (task, payload, queue, due_at, priority)"
        " SELECT 't.claim', '{}', 'q', now() - interval '60 s' + g * interval '1 ms',"
        " CASE WHEN g % 1000 = 0 THEN 5 ELSE 0 END FROM generate_series(1, 40000) g"
    )
    store = DispatchStore(pool)
    async with pool.acquire() as conn, conn.transaction():
        jobs = await store.claim(conn, 500)
        read = await job_rows_read(conn)
        sort = await conn.fetchval("SHOW enable_sort")
    assert len(jobs) == 500
    assert read <= 1_000, f"the claim read {read} job rows for 500"
    assert sort == "on"
    # the 40 jobs of priority 5 first, then the others by run time
    ordered = await pool.fetch(
        "SELECT id FROM duetime.jobs ORDER BY priority DESC, due_at, id LIMIT 500"
    )
    assert [j.id for j in jobs] == [r["id"] for r in ordered]
