"""The benchmark handler: ``duetime worker --import bench.tasks``.

``bench.record`` writes the wall-clock instant it started (taken before any I/O) into
``bench_starts`` through ``ctx.db``, so the row commits exactly once with the ledger row
and the job's ``succeeded``: a second row for a job would be a duplicate *effect*, which
is what the scenarios count. ``bench_starts`` has no key on purpose (a key would hide
duplicates by failing them).
"""

from __future__ import annotations

import time
from typing import Any

from workers import JobContext, task

STARTS_TABLE = "bench_starts"
STARTS_DDL = f"""
CREATE TABLE IF NOT EXISTS {STARTS_TABLE} (
    job_id      bigint           NOT NULL,
    attempt     integer          NOT NULL,
    due_at      timestamptz      NOT NULL,
    started_at  double precision NOT NULL    -- epoch seconds, at handler entry
)
"""
INSERT_START = (
    f"INSERT INTO {STARTS_TABLE} (job_id, attempt, due_at, started_at) VALUES ($1, $2, $3, $4)"
)


@task("bench.record", timeout=60)
async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
    started = time.time()
    await ctx.db.execute(INSERT_START, ctx.job_id, ctx.attempt, ctx.due_at, started)


@task("bench.record_shared", timeout=60, share_transaction=True)
async def record_shared(ctx: JobContext, payload: dict[str, Any]) -> None:
    """``bench.record`` in a task that opted into transaction groups (DESIGN §15): what
    the one-transaction-per-attempt default costs a storm (``bench storm --share-transaction``)."""
    started = time.time()
    await ctx.db.execute(INSERT_START, ctx.job_id, ctx.attempt, ctx.due_at, started)
