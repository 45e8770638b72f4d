"""Example tasks for the compose stack: ``duetime worker --import example_tasks``.

Publish one from the host (PostgreSQL is published on 127.0.0.1:5432)::

    psql postgresql://duetime:duetime@127.0.0.1:5432/duetime -c \
      "INSERT INTO duetime.jobs (task, payload, due_at)
       VALUES ('example.hello', '{\"name\": \"world\"}', now() + interval '5 seconds')"
"""

from __future__ import annotations

import asyncio
from typing import Any

from duetime import JobContext, task


@task("example.hello")
async def hello(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Log a greeting: shows the job arriving, with its lag, in the worker's log."""
    ctx.log.info("hello", name=payload.get("name", "world"))


@task("example.sleep", timeout=120)
async def sleep(ctx: JobContext, payload: dict[str, Any]) -> None:
    """Sleep ``seconds`` (default 1): something to watch during a worker restart."""
    await asyncio.sleep(float(payload.get("seconds", 1)))
