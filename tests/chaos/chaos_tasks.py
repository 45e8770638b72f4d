"""The checking handler of the chaos suite: ``duetime worker --import tests.chaos.chaos_tasks``.

``chaos.check`` is built so that the check after a run cannot be fooled:

1. it reads the job row's ``dispatch_epoch`` through ``ctx.db`` (the row is locked by
   the worker's ledger transaction, so this is the epoch of the committed claim the
   delivery belongs to; ``JobContext`` does not expose the message's ``epoch``);
2. it records the delivery ``(job_id, attempt, node, pid, epoch)`` on a *separate
   autocommit* connection, straight to PostgreSQL (``CHAOS_RECORD_DSN``, not through the
   fault proxies, so the record survives whatever happens to the handler's transaction
   and is never itself disturbed by the fault under test);
3. it inserts ``(job_id)`` into ``chaos_effects`` through ``ctx.db`` — a table with **no
   unique constraint**, so an effect applied twice shows up as two rows instead of
   being silently absorbed by a constraint;
4. it then sleeps a little (``sleep_ms``), so a worker killed -9 at a random instant is
   usually caught *mid-handler*, after its effect was written but before the commit;
5. ``fail_attempts: n`` makes attempts ``1..n`` raise after writing their effect, so
   the rollback of a failed attempt's ``ctx.db`` work is checked too.

If the delivery cannot be recorded, the handler raises before writing its effect: an
effect without a recorded delivery is impossible. The recorder pool lives as long as
the worker process (a test process: it is killed or exits, which closes it).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import asyncpg

from workers import JobContext, task
from workers.retry import RetryPolicy

TASK = "chaos.check"
RECORD_DSN_ENV = "CHAOS_RECORD_DSN"  # not DUETIME_*: Settings rejects unknown DUETIME_ names
RECORD_TIMEOUT = 5.0

CHECK_SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS public.chaos_effects (   -- deliberately no unique constraint
    job_id   bigint      NOT NULL,
    attempt  integer     NOT NULL,
    node     text        NOT NULL,
    pid      integer     NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS public.chaos_deliveries (
    id       bigserial   PRIMARY KEY,
    job_id   bigint      NOT NULL,
    attempt  integer     NOT NULL,
    node     text        NOT NULL,
    pid      integer     NOT NULL,
    epoch    bigint,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS chaos_deliveries_job ON public.chaos_deliveries (job_id);
"""

_pool: asyncpg.Pool | None = None
_pool_lock = asyncio.Lock()


class PlannedFailure(Exception):
    """Raised on purpose (``fail_attempts``): the attempt's effect must be rolled back."""


async def _recorder() -> asyncpg.Pool:
    global _pool
    if _pool is None:
        async with _pool_lock:
            if _pool is None:
                dsn = os.environ.get(RECORD_DSN_ENV) or os.environ["DUETIME_DATABASE_URL"]
                _pool = await asyncpg.create_pool(
                    dsn,
                    min_size=1,
                    max_size=2,
                    timeout=RECORD_TIMEOUT,
                    command_timeout=RECORD_TIMEOUT,
                    server_settings={"application_name": "chaos-recorder"},
                )
    return _pool


@task(TASK, timeout=30, retry=RetryPolicy(base=0.2, factor=2.0, cap=2.0))
async def check(ctx: JobContext, payload: dict[str, Any]) -> None:
    epoch = await ctx.db.fetchval(
        "SELECT dispatch_epoch FROM duetime.jobs WHERE id = $1 AND due_at = $2",
        ctx.job_id,
        ctx.due_at,
    )
    node = os.environ.get("DUETIME_NODE_ID", "?")
    pid = os.getpid()
    pool = await _recorder()
    await pool.execute(
        "INSERT INTO public.chaos_deliveries (job_id, attempt, node, pid, epoch) "
        "VALUES ($1, $2, $3, $4, $5)",
        ctx.job_id,
        ctx.attempt,
        node,
        pid,
        epoch,
        timeout=RECORD_TIMEOUT,
    )
    await ctx.db.execute(
        "INSERT INTO public.chaos_effects (job_id, attempt, node, pid) VALUES ($1, $2, $3, $4)",
        ctx.job_id,
        ctx.attempt,
        node,
        pid,
    )
    sleep_ms = float(payload.get("sleep_ms", 0))
    if sleep_ms > 0:
        await asyncio.sleep(sleep_ms / 1000)
    if ctx.attempt <= int(payload.get("fail_attempts", 0)):
        raise PlannedFailure(f"planned failure of attempt {ctx.attempt}")
