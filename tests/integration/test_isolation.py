"""One attempt's ``ctx.db`` work is a transaction of its own (DESIGN §15).

Three things every PostgreSQL user assumes of a transaction, each checked with jobs that
run at the same time in one worker, against real PostgreSQL and RabbitMQ:

- transaction-local settings (``set_config(..., true)``, what ``SET LOCAL`` does, the
  usual way to hand a tenant to row-level security) are seen by nobody else;
- ``pg_advisory_xact_lock`` keeps two attempts apart;
- another job's failure never runs a handler again (its external calls would repeat).

Sharing a transaction is the opt-in of ``share_transaction=True``
(tests/integration/test_executor.py checks what sharing still guarantees).
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from scheduler.config import Settings
from tests.fixtures_tasks.jobs import DispatchedJob, dispatched_job, effects, publish
from tests.support.helpers import running_worker
from tests.support.wait import wait_for
from workers import JobContext, Registry

pytestmark = pytest.mark.timeout(90)


async def _burst(
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    task: str,
    payloads: list[dict[str, Any]],
) -> list[DispatchedJob]:
    """Jobs queued before the worker starts, so it takes them as one burst."""
    jobs = [await dispatched_job(db_pool, task, p, queue=queue) for p in payloads]
    for job in jobs:
        await publish(channel, queue, job.message(1))
    return jobs


async def _finished(pool: asyncpg.Pool, jobs: list[DispatchedJob]) -> bool:
    left = await pool.fetchval(
        "SELECT count(*) FROM duetime.jobs WHERE id = ANY($1::bigint[]) AND status = 'dispatched'",
        [j.id for j in jobs],
    )
    return left == 0


async def test_transaction_local_settings_are_seen_by_no_other_job(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    """Half the handlers set a tenant with ``set_config(..., true)`` and read it back
    after an await; the other half only read it. Nobody sees another job's tenant."""
    registry = Registry()
    seen: dict[int, tuple[str | None, str | None]] = {}  # job -> (set, read back)

    @registry.task("t.tenant")
    async def tenant(ctx: JobContext, payload: dict[str, Any]) -> None:
        mine = payload.get("tenant")
        if mine is not None:
            await ctx.db.execute("SELECT set_config('app.tenant', $1, true)", mine)
        await asyncio.sleep(0.002)
        read = await ctx.db.fetchval("SELECT current_setting('app.tenant', true)")
        seen[ctx.job_id] = (mine, read or None)

    payloads = [{"tenant": f"tenant-{i}"} if i % 2 == 0 else {} for i in range(120)]
    jobs = await _burst(db_pool, channel, queue, "t.tenant", payloads)
    async with running_worker(settings, registry, queue, concurrency=8):
        await wait_for(lambda: _finished(db_pool, jobs), timeout=60)
    assert len(seen) == len(jobs)
    leaks = {job: pair for job, pair in seen.items() if pair[0] != pair[1]}
    assert leaks == {}, f"{len(leaks)} of {len(seen)} jobs saw another job's tenant"


async def test_an_advisory_transaction_lock_keeps_two_jobs_apart(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """Every job of one customer takes ``pg_advisory_xact_lock(customer)`` first: no two
    of them ever run their critical section at the same time."""
    registry = Registry()
    inside = 0
    overlaps = 0

    @registry.task("t.customer")
    async def customer(ctx: JobContext, payload: dict[str, Any]) -> None:
        nonlocal inside, overlaps
        await ctx.db.execute("SELECT pg_advisory_xact_lock($1)", payload["customer"])
        inside += 1
        overlaps += inside > 1
        await asyncio.sleep(0.003)
        await ctx.db.execute(
            f"INSERT INTO {effects_table} (job_id, attempt) VALUES ($1, $2)",
            ctx.job_id,
            ctx.attempt,
        )
        inside -= 1

    jobs = await _burst(db_pool, channel, queue, "t.customer", [{"customer": 7}] * 40)
    async with running_worker(settings, registry, queue, concurrency=8):
        await wait_for(lambda: _finished(db_pool, jobs), timeout=60)
    assert overlaps == 0, f"{overlaps} runs overlapped under one advisory lock"
    for job in jobs:
        assert await effects(db_pool, job, effects_table) == 1


async def test_another_jobs_failure_never_runs_a_handler_again(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """Handlers make an external call (counted here), write through ctx.db, and one of
    them fails after its neighbours wrote: each healthy handler ran exactly once."""
    registry = Registry()
    calls: dict[int, int] = {}
    wrote = asyncio.Event()

    @registry.task("t.mail")
    async def mail(ctx: JobContext, payload: dict[str, Any]) -> None:
        calls[ctx.job_id] = calls.get(ctx.job_id, 0) + 1  # "sent an email"
        await ctx.db.execute(
            f"INSERT INTO {effects_table} (job_id, attempt) VALUES ($1, $2)",
            ctx.job_id,
            ctx.attempt,
        )
        if payload.get("fail") and ctx.attempt == 1:
            await wrote.wait()
            raise RuntimeError("planned failure")
        wrote.set()

    payloads: list[dict[str, Any]] = [{}] * 12 + [{"fail": True}]
    jobs = await _burst(db_pool, channel, queue, "t.mail", payloads)
    healthy, bad = jobs[:-1], jobs[-1]
    async with running_worker(settings, registry, queue, concurrency=16):
        await wait_for(lambda: _finished(db_pool, jobs), timeout=60)
    assert {job.id: calls.get(job.id) for job in healthy} == {job.id: 1 for job in healthy}
    for job in healthy:
        assert await effects(db_pool, job, effects_table) == 1
    assert await effects(db_pool, bad, effects_table) == 0


async def test_the_settling_statement_travels_with_its_commit_safely(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """An attempt's last statement and its COMMIT go in one round trip, as text: keys and
    task names with quotes, backslashes and SQL in them are settled as the values they are;
    a COMMIT that fails (a deferred constraint) is a failed attempt; and the one pooled
    connection (concurrency 1) serves every later attempt's transaction and savepoints."""
    registry = Registry()
    await db_pool.execute(
        "CREATE TABLE IF NOT EXISTS isolation_deferred (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)"
    )
    hostile = "o'brien\\'; DROP TABLE duetime.jobs; -- E'\\\\x27"
    task_name = "t.quote'\\name"
    order: list[str] = []

    @registry.task(task_name)
    async def quoted(ctx: JobContext, payload: dict[str, Any]) -> None:
        if payload.get("defer"):
            await ctx.db.execute("INSERT INTO isolation_deferred VALUES (1), (1)")
        async with ctx.db.transaction():
            await ctx.db.execute(
                f"INSERT INTO {effects_table} (job_id, attempt) VALUES ($1, $2)",
                ctx.job_id,
                ctx.attempt,
            )
        conn = await ctx.db.connection()
        assert conn.is_in_transaction()
        order.append(payload.get("n", "defer"))

    first = await dispatched_job(
        db_pool, task_name, {"n": "a"}, queue=queue, idempotency_key=hostile
    )
    deferred = await dispatched_job(db_pool, task_name, {"defer": True}, queue=queue)
    rest = [await dispatched_job(db_pool, task_name, {"n": str(i)}, queue=queue) for i in range(3)]
    jobs = [first, deferred, *rest]
    for job in jobs:
        await publish(channel, queue, job.message(1))
    try:
        async with running_worker(settings, registry, queue, concurrency=1):
            await wait_for(lambda: _finished(db_pool, jobs), timeout=60)
        statuses = dict(
            await db_pool.fetch(
                "SELECT id, status FROM duetime.jobs WHERE id = ANY($1::bigint[])",
                [j.id for j in jobs],
            )
        )
        assert statuses[deferred.id] == "pending"  # its COMMIT failed: a failed attempt
        assert all(statuses[j.id] == "succeeded" for j in [first, *rest])
        ledger = await db_pool.fetch(
            "SELECT idempotency_key, task FROM duetime.job_ledger WHERE job_id = $1", first.id
        )
        assert len(ledger) == 1 and ledger[0]["task"] == task_name
        assert ledger[0]["idempotency_key"].endswith(hostile)
        assert await db_pool.fetchval("SELECT count(*) FROM duetime.jobs") >= len(jobs)
        for job in [first, *rest]:
            assert await effects(db_pool, job, effects_table) == 1
        assert await effects(db_pool, deferred, effects_table) == 0
        assert (
            "unique"
            in (
                await db_pool.fetchval(
                    "SELECT last_error FROM duetime.jobs WHERE id = $1", deferred.id
                )
            ).lower()
        )
    finally:
        await db_pool.execute("DROP TABLE IF EXISTS isolation_deferred")
