"""The sharded-cluster tests' handler: ``duetime worker --import tests.fixtures_tasks.shards``.

``shards.record`` writes one row to ``shard_effects`` through ``ctx.db``: the job id,
the attempt, the dispatching epoch (read from the job row the ledger transaction has
locked) and ``current_database()``, the database ``ctx.db`` is on, so a test proves the
effect landed in the job's own shard. The table has **no unique constraint**: an effect
applied twice shows up as two rows instead of being absorbed. ``sleep_ms`` keeps the
handler busy a little, so a crash catches work in flight.
"""

from __future__ import annotations

import asyncio
from typing import Any

from workers import JobContext, task
from workers.retry import RetryPolicy

TASK = "shards.record"
EFFECTS_TABLE = "public.shard_effects"
EFFECTS_DDL = f"""
CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (   -- deliberately no unique constraint
    job_id   bigint      NOT NULL,
    attempt  integer     NOT NULL,
    epoch    bigint,
    db       text        NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


@task(TASK, timeout=30, retry=RetryPolicy(base=0.2, factor=2.0, cap=2.0))
async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
    await ctx.db.execute(
        f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, epoch, db) "
        "SELECT $1, $2, dispatch_epoch, current_database() FROM duetime.jobs "
        "WHERE id = $1 AND due_at = $3",
        ctx.job_id,
        ctx.attempt,
        ctx.due_at,
    )
    sleep_ms = float(payload.get("sleep_ms", 0))
    if sleep_ms > 0:
        await asyncio.sleep(sleep_ms / 1000)
