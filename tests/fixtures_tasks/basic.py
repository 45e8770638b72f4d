"""Handlers for worker-process tests: ``duetime worker --import tests.fixtures_tasks.basic``.

``fixtures.record`` optionally appends its process id to a file (``starts_file``: every
run counted, whichever process), writes one row to ``worker_test_effects`` through
``ctx.db`` (so it commits exactly once, with the ledger row), then optionally heartbeats (the test's
signal that the handler is running), waits while a file exists (the test decides when
it may finish), and sleeps. ``fixtures.sync_stuck`` is a plain def that overruns its
timeout.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from workers import JobContext, SyncJobContext, task

EFFECTS_TABLE = "worker_test_effects"
EFFECTS_DDL = f"""
CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (
    id         bigserial PRIMARY KEY,
    job_id     bigint NOT NULL,
    attempt    integer NOT NULL,
    tag        text,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


@task("fixtures.record", timeout=120)
async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
    starts = payload.get("starts_file")
    if starts:  # one line per run, naming the process: runs across processes are countable
        with open(starts, "a") as out:  # noqa: ASYNC230 — a line appended to a local file
            out.write(f"{os.getpid()}\n")
    await ctx.db.execute(
        f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, $3)",
        ctx.job_id,
        ctx.attempt,
        payload.get("tag"),
    )
    if payload.get("beat"):
        await ctx.heartbeat()
    hold = payload.get("hold_while_exists")
    if hold:
        while os.path.exists(hold):  # noqa: ASYNC110, ASYNC240 — a stat; the test owns it
            await asyncio.sleep(0.05)
    if payload.get("sleep"):
        await asyncio.sleep(float(payload["sleep"]))


@task("fixtures.fail")
async def fail(ctx: JobContext, payload: dict[str, Any]) -> None:
    raise ValueError(f"boom on attempt {ctx.attempt}")


@task("fixtures.sync_stuck", timeout=0.5)
def sync_stuck(ctx: SyncJobContext, payload: dict[str, Any]) -> None:
    """A plain def handler that overruns its timeout: writes, then blocks its thread for
    ``block`` seconds (default 30), which no timeout can interrupt."""
    ctx.db.execute(
        f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, 'stuck')",
        ctx.job_id,
        ctx.attempt,
    )
    time.sleep(float(payload.get("block", 30)))
