"""A handler's statements are bounded by its task's timeout, not by the pool's.

The pools bound statements at 3 x ``db_timeout`` (30 s by default) on the client side;
a handler's ``ctx.db`` statement must not fail there with a bare ``TimeoutError``
whatever its task allows. Here ``db_timeout`` is 1 s (a 3 s bound), so a handler bounded
by the pool instead of its task would show in seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from scheduler.config import Settings
from tests.fixtures_tasks.jobs import dispatched_job, job_row, publish
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker

pytestmark = pytest.mark.timeout(90)


async def _run(
    settings: Settings, registry: Registry, queue: str, jobs: list[Any], db_pool: asyncpg.Pool
) -> list[asyncpg.Record]:
    worker = Worker(
        dataclasses.replace(settings, db_timeout=1.0),
        queues=[queue],
        registry=registry,
        concurrency=4,
    )
    await worker.start()
    try:

        async def settled() -> bool:
            rows = [await job_row(db_pool, job) for job in jobs]
            return all(r["status"] != "dispatched" for r in rows)

        await wait_for(settled, timeout=60)
    finally:
        await worker.stop()
    return [await job_row(db_pool, job) for job in jobs]


async def test_the_tasks_timeout_bounds_its_statements_and_says_so(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    """A 4.5 s statement in a task allowed 8 s succeeds (it failed at the pool's 3 s);
    a 30 s statement in a task allowed 2 s fails as the task's timeout, and the server
    stops running it; a statement given ``timeout=`` fails naming that bound."""
    registry = Registry()

    @registry.task("t.report", timeout=8)
    async def report(ctx: JobContext, payload: dict[str, Any]) -> None:
        await ctx.db.execute("SELECT pg_sleep(4.5)")

    @registry.task("t.runaway", timeout=2)
    async def runaway(ctx: JobContext, payload: dict[str, Any]) -> None:
        await ctx.db.execute("SELECT pg_sleep(30) /* runaway */")

    @registry.task("t.own_bound")
    async def own_bound(ctx: JobContext, payload: dict[str, Any]) -> None:
        await ctx.db.execute("SELECT pg_sleep(10) /* own bound */", timeout=0.5)

    jobs = [
        await dispatched_job(db_pool, name, queue=queue)
        for name in ("t.report", "t.runaway", "t.own_bound")
    ]
    for job in jobs:
        await publish(channel, queue, job.message(1))
    report_row, runaway_row, own_row = await _run(settings, registry, queue, jobs, db_pool)
    assert report_row["status"] == "succeeded", report_row["last_error"]
    assert runaway_row["status"] == "pending"
    assert "handler exceeded its timeout of 2s" in runaway_row["last_error"]
    assert own_row["status"] == "pending"
    assert "timeout=0.5s given to it" in own_row["last_error"]

    async def cancelled_on_the_server() -> bool:
        running = await db_pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(%) /* %' "
            "AND state = 'active' AND pid <> pg_backend_pid()"
        )
        return running == 0

    await wait_for(cancelled_on_the_server, timeout=10)
