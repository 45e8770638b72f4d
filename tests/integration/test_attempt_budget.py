"""The attempt budget a job shows is the one that applied.

A task registered with ``max_attempts=2`` replaces the row's ``max_attempts`` (5 by
default): the worker gives up after attempt 2. The failure outcomes (``schedule_retry``,
``mark_dead``) write that budget into the row, so ``duetime jobs show/list`` and the
dashboard say "2 of 2", not "2 of 5". A task without a budget of its own keeps the row's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from scheduler.config import Settings
from tests.fixtures_tasks.jobs import dispatched_job, job_row, publish, redispatch
from tests.support.cli import run_duetime as duetime
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker

pytestmark = pytest.mark.timeout(60)


async def test_a_dead_job_shows_the_budget_of_its_task(
    settings: Settings,
    test_env: dict[str, str],
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    registry = Registry()

    @registry.task("budget.two", max_attempts=2)
    async def two(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise RuntimeError(f"attempt {ctx.attempt} of {ctx.max_attempts} failed")

    @registry.task("budget.row")
    async def row_budget(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise RuntimeError("fails")

    budgeted = await dispatched_job(db_pool, "budget.two", queue=queue)  # row: 5
    plain = await dispatched_job(db_pool, "budget.row", queue=queue, max_attempts=4)

    async def status(job: Any) -> tuple[str, int, int]:
        row = await job_row(db_pool, job)
        return row["status"], row["attempt"], row["max_attempts"]

    worker = Worker(dataclasses.replace(settings), queues=[queue], registry=registry)
    await worker.start()
    try:
        await publish(channel, queue, budgeted.message(1))
        await publish(channel, queue, plain.message(1))

        async def retried() -> bool:
            return await status(budgeted) == ("pending", 2, 2) and (
                await status(plain) == ("pending", 2, 4)
            )

        await wait_for(retried, timeout=15)
        await publish(channel, queue, budgeted.message(await redispatch(db_pool, budgeted)))

        async def dead() -> bool:
            return await status(budgeted) == ("dead", 2, 2)

        await wait_for(dead, timeout=15)
    finally:
        await worker.stop()

    shown = await duetime(test_env, "jobs", "show", str(budgeted.id))
    assert shown.code == 0, shown
    fields = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in shown.out.splitlines()}
    assert (fields["status"], fields["attempt"], fields["max_attempts"]) == ("dead", "2 of 2", "2")
    listed = await duetime(test_env, "jobs", "list", "--queue", queue, "--status", "dead")
    assert listed.code == 0, listed
    rows = [line.split() for line in listed.out.splitlines()[1:]]
    assert [(r[0], r[4]) for r in rows] == [(str(budgeted.id), "2/2")]
