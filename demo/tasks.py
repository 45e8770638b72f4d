"""The demo's task handlers: ``duetime worker --import demo.tasks``.

Each handler's only effect is one row in ``demo_effects``, written through ``ctx.db``:
it commits in the same transaction as the idempotency-ledger row and the job's
``succeeded`` status, so the table holds exactly one row per job if duetime keeps its
promise (DESIGN §1.2). The table deliberately has no unique constraint on the job: a
second effect would be *counted* by the demo as a duplicate, not hidden by an error.

``started_at`` is the database's ``clock_timestamp()`` at the handler's first statement,
the same clock that decided the job was due, so the lag (start − due_at) is not skewed
when PostgreSQL runs on another host.
"""

from __future__ import annotations

import os
from typing import Any

from demo.store import Q
from workers import JobContext, task

JOB_TASK = "demo.record"
CRON_TASK = "demo.tick"


def _worker_name() -> str:
    return os.environ.get("DUETIME_NODE_ID") or f"pid-{os.getpid()}"


@task(JOB_TASK, timeout=30)
async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
    """A one-shot demo job: record that job number ``payload["n"]`` ran, and when."""
    await ctx.db.execute(
        Q["record_effect"],
        "job",
        int(payload["n"]),
        None,
        ctx.job_id,
        ctx.attempt,
        ctx.due_at,
        _worker_name(),
    )


@task(CRON_TASK, timeout=30)
async def tick(ctx: JobContext, payload: dict[str, Any]) -> None:
    """A cron fire: record which schedule fired, for which nominal time (``due_at``)."""
    await ctx.db.execute(
        Q["record_effect"],
        "cron",
        None,
        str(payload.get("schedule", "?")),
        ctx.job_id,
        ctx.attempt,
        ctx.due_at,
        _worker_name(),
    )
