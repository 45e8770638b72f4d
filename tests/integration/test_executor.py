"""The executor's batching and grouping (workers/executor.py, workers/groups.py,
workers/batching.py) against real PostgreSQL and RabbitMQ, in-process.

Like tests/integration/test_worker.py, each test plays the dispatcher by hand
(``tests.fixtures_tasks.jobs``) and runs a ``Worker`` with a registry of its own. What is
checked here is what batching must never change: the row decides what runs, every effect
through ``ctx.db`` is applied exactly once whatever its neighbours in a shared
transaction do, a failure costs only its own attempt, and every delivery is acked once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel
from prometheus_client import REGISTRY

from scheduler.config import Settings
from tests.fixtures_tasks.basic import EFFECTS_TABLE
from tests.fixtures_tasks.jobs import (
    DispatchedJob,
    dispatched_job,
    effects,
    job_row,
    publish,
    queue_depth,
)
from tests.support.helpers import running_worker
from tests.support.wait import wait_for
from workers import JobContext, Registry, Retry, Worker, shards
from workers.retry import MAX_RETRY_DELAY

pytestmark = pytest.mark.timeout(60)
#: The label set of an unsharded worker's metrics.
MAIN = {"shard": "main"}


async def _statuses(pool: asyncpg.Pool, jobs: list[DispatchedJob]) -> dict[int, tuple[str, int]]:
    rows = await pool.fetch(
        "SELECT id, status, attempt FROM duetime.jobs WHERE id = ANY($1::bigint[])",
        [j.id for j in jobs],
    )
    return {r["id"]: (r["status"], r["attempt"]) for r in rows}


async def _settled(worker: Worker, channel: AbstractChannel, queue: str) -> bool:
    assert worker.consumer is not None
    return await queue_depth(channel, queue) == (0, 1) and worker.consumer.in_flight == 0


def _insert(ctx: JobContext, tag: str | None = None) -> Any:
    return ctx.db.execute(
        f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, $3)",
        ctx.job_id,
        ctx.attempt,
        tag,
    )


async def test_a_forged_message_runs_the_rows_task_never_its_own(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """A message naming a real job but another task and payload: the row is
    authoritative. The job's own task runs with the row's payload; the forged task never
    runs; the disagreement is counted as a security event."""
    registry = Registry()
    ran: list[tuple[str, dict[str, Any]]] = []

    @registry.task("t.real")
    async def real(ctx: JobContext, payload: dict[str, Any]) -> None:
        ran.append(("t.real", payload))
        await _insert(ctx, "real")

    @registry.task("t.admin")
    async def admin(ctx: JobContext, payload: dict[str, Any]) -> None:
        ran.append(("t.admin", payload))

    job = await dispatched_job(db_pool, "t.real", {"from": "row"}, queue=queue)
    forged = dataclasses.replace(job, payload={"grant": "everything"}, key="forged:key")
    before = REGISTRY.get_sample_value("duetime_message_row_mismatch_total", MAIN) or 0.0
    async with running_worker(settings, registry, queue) as worker:
        await publish(channel, queue, forged.message(1, task="t.admin"))
        await wait_for(lambda: _settled(worker, channel, queue), timeout=10)
    assert ran == [("t.real", {"from": "row"})]
    assert (await job_row(db_pool, job))["status"] == "succeeded"
    assert await effects(db_pool, job, effects_table) == 1
    ledger = await db_pool.fetchrow(
        "SELECT idempotency_key, task FROM duetime.job_ledger WHERE job_id = $1", job.id
    )
    assert (ledger["idempotency_key"], ledger["task"]) == (f"job:{job.id}", "t.real")
    after = REGISTRY.get_sample_value("duetime_message_row_mismatch_total", MAIN) or 0.0
    assert after == before + 1


async def test_a_failing_neighbour_costs_the_group_a_rerun_not_an_attempt(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """Attempts of a task that opted in and start together share a transaction. One of
    them writes, then
    raises: the group rolls back, the failing job is retried (its write gone), every
    other job runs again alone and commits its effect exactly once, at attempt 1."""
    registry = Registry()
    runs: dict[int, int] = {}
    gate = asyncio.Event()

    @registry.task("t.group", share_transaction=True)
    async def grouped(ctx: JobContext, payload: dict[str, Any]) -> None:
        runs[ctx.job_id] = runs.get(ctx.job_id, 0) + 1
        await _insert(ctx, payload.get("tag"))
        if payload.get("fail") and ctx.attempt == 1:
            await gate.wait()  # fail only once every neighbour has written
            raise RuntimeError("planned failure")

    jobs = [await dispatched_job(db_pool, "t.group", {"tag": "ok"}, queue=queue) for _ in range(8)]
    bad = await dispatched_job(db_pool, "t.group", {"fail": True}, queue=queue)
    for job in [*jobs, bad]:  # queued first: the worker gets them as one burst
        await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue) as worker:
        await wait_for(lambda: sum(runs.values()) >= len(jobs) + 1, timeout=10)
        gate.set()
        await wait_for(
            lambda: _all(db_pool, jobs, ("succeeded", 1)), timeout=15, message="neighbours"
        )
        await wait_for(lambda: _all(db_pool, [bad], ("pending", 2)), timeout=15)
        await wait_for(lambda: _settled(worker, channel, queue), timeout=10)
        assert worker.executor is not None
        assert worker.executor.batching()["groups"] < len(jobs) + 1  # they did share
    for job in jobs:
        assert await effects(db_pool, job, effects_table) == 1
    assert await effects(db_pool, bad, effects_table) == 0  # rolled back with its attempt
    assert "planned failure" in (await job_row(db_pool, bad))["last_error"]
    assert any(n == 2 for n in runs.values()), "a neighbour was run again alone"


async def test_a_statement_error_poisons_only_the_shared_transaction(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """A handler whose SQL fails aborts the shared transaction: its neighbours' later
    statements are not sent (GroupAborted), they run again alone and succeed; the
    faulty job is a failed attempt with PostgreSQL's error."""
    registry = Registry()
    wrote = asyncio.Event()

    @registry.task("t.sql", share_transaction=True)
    async def sql(ctx: JobContext, payload: dict[str, Any]) -> None:
        if payload.get("bad"):
            await wrote.wait()
            await ctx.db.execute("SELECT 1/0")
        await _insert(ctx)
        wrote.set()
        await asyncio.sleep(0.2)
        await _insert(ctx, "second")

    good = [await dispatched_job(db_pool, "t.sql", {}, queue=queue) for _ in range(4)]
    bad = await dispatched_job(db_pool, "t.sql", {"bad": True}, queue=queue)
    for job in [bad, *good]:  # queued first: the worker gets them as one burst
        await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue) as worker:
        await wait_for(lambda: _all(db_pool, good, ("succeeded", 1)), timeout=15)
        await wait_for(lambda: _all(db_pool, [bad], ("pending", 2)), timeout=15)
        await wait_for(lambda: _settled(worker, channel, queue), timeout=10)
    for job in good:
        assert await effects(db_pool, job, effects_table) == 2  # both writes, once
    assert "DivisionByZero" in (await job_row(db_pool, bad))["last_error"]


async def test_tasks_that_do_not_opt_in_never_share_and_savepoints(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """A task that does not say ``share_transaction=True`` never shares a transaction
    (``isolated=True``, the old spelling of the default, is still accepted); a savepoint
    that fails inside a shared transaction rolls back only its own block."""
    registry = Registry()
    conns: dict[int, int] = {}

    @registry.task("t.alone", isolated=True)
    async def alone(ctx: JobContext, payload: dict[str, Any]) -> None:
        conns[ctx.job_id] = await ctx.db.fetchval("SELECT pg_backend_pid()")
        await _insert(ctx)
        await asyncio.sleep(0.05)

    @registry.task("t.savepoint", share_transaction=True)
    async def savepoint(ctx: JobContext, payload: dict[str, Any]) -> None:
        await _insert(ctx, "kept")
        with contextlib.suppress(asyncpg.DivisionByZeroError):
            async with ctx.db.transaction():
                await _insert(ctx, "undone")
                await ctx.db.execute("SELECT 1/0")

    alone_jobs = [await dispatched_job(db_pool, "t.alone", queue=queue) for _ in range(4)]
    sp_jobs = [await dispatched_job(db_pool, "t.savepoint", queue=queue) for _ in range(4)]
    for job in [*alone_jobs, *sp_jobs]:
        await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue) as worker:
        await wait_for(lambda: _all(db_pool, alone_jobs + sp_jobs, ("succeeded", 1)), timeout=15)
        await wait_for(lambda: _settled(worker, channel, queue), timeout=10)
    assert len(set(conns.values())) == len(alone_jobs)  # each its own connection at once
    for job in sp_jobs:
        tags = await db_pool.fetch(
            f"SELECT tag FROM {EFFECTS_TABLE} WHERE job_id = $1 ORDER BY id", job.id
        )
        assert [t["tag"] for t in tags] == ["kept"]


async def test_handlers_without_ctx_db_are_completed_and_acked_in_batches(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    registry = Registry()

    @registry.task("t.noop")
    async def noop(ctx: JobContext, payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.05)

    jobs = [await dispatched_job(db_pool, "t.noop", queue=queue) for _ in range(40)]
    for job in jobs:
        await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue, concurrency=40) as worker:
        await wait_for(lambda: _all(db_pool, jobs, ("succeeded", 1)), timeout=15)
        await wait_for(lambda: _settled(worker, channel, queue), timeout=10)
        assert worker.executor is not None and worker.consumer is not None
        stats = worker.executor.batching()
        assert stats["complete_per_batch"] > 1 and stats["begin_per_batch"] > 1
        assert worker.consumer.ack_frames < len(jobs)
    keys = await db_pool.fetchval(
        "SELECT count(*) FROM duetime.job_ledger WHERE job_id = ANY($1::bigint[])",
        [j.id for j in jobs],
    )
    assert keys == len(jobs)


async def test_retry_delays_are_bounded_and_hostile_errors_are_recorded(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    """``Retry(in_=1e13)`` once overflowed the database's interval arithmetic and the
    delivery was requeued forever; an exception whose ``str()`` raises or is 10 MB must
    be recorded too. Each handler runs exactly once and its job is pending again."""
    registry = Registry()
    calls: dict[str, int] = {}

    class Hostile(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text for you")

    @registry.task("t.far")
    async def far(ctx: JobContext, payload: dict[str, Any]) -> None:
        calls["far"] = calls.get("far", 0) + 1
        raise Retry(in_=1e13)

    @registry.task("t.hostile")
    async def hostile(ctx: JobContext, payload: dict[str, Any]) -> None:
        calls["hostile"] = calls.get("hostile", 0) + 1
        raise Hostile()

    @registry.task("t.huge")
    async def huge(ctx: JobContext, payload: dict[str, Any]) -> None:
        calls["huge"] = calls.get("huge", 0) + 1
        raise ValueError("x\x00\ud800" * 3_500_000)

    jobs = {
        n: await dispatched_job(db_pool, f"t.{n}", queue=queue) for n in ("far", "hostile", "huge")
    }
    async with running_worker(settings, registry, queue) as worker:
        for job in jobs.values():
            await publish(channel, queue, job.message(1))
        await wait_for(lambda: _all(db_pool, list(jobs.values()), ("pending", 2)), timeout=15)
        await wait_for(lambda: _settled(worker, channel, queue), timeout=10)
        await asyncio.sleep(0.5)  # nothing may run again (a requeue loop would)
    assert calls == {"far": 1, "hostile": 1, "huge": 1}
    far_row = await job_row(db_pool, jobs["far"])
    expected = datetime.now(UTC) + timedelta(seconds=MAX_RETRY_DELAY)
    assert abs((far_row["run_at"] - expected).total_seconds()) < 60
    assert (await job_row(db_pool, jobs["hostile"]))["last_error"] == (
        "Hostile: <str() raised RuntimeError>"
    )
    assert len((await job_row(db_pool, jobs["huge"]))["last_error"]) <= 2000 * 4


async def test_a_row_the_worker_cannot_read_is_parked_and_its_batch_runs(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """A payload nested deeper than Python's JSON parser goes fails the batched read of
    every delivery it arrives with. Before, the whole batch would be requeued forever:
    now the batch is read again row by row, that job is dead with the reason, and its
    neighbours run."""
    registry = Registry()

    @registry.task("t.rec")
    async def rec(ctx: JobContext, payload: dict[str, Any]) -> None:
        await _insert(ctx)

    jobs = [await dispatched_job(db_pool, "t.rec", {"i": i}, queue=queue) for i in range(6)]
    deep = await dispatched_job(db_pool, "t.rec", {}, queue=queue)
    await db_pool.execute(
        "UPDATE duetime.jobs SET payload = ('{\"a\": ' || repeat('[', 5000) || "
        "repeat(']', 5000) || '}')::jsonb WHERE id = $1",
        deep.id,
    )
    for job in [*jobs[:3], deep, *jobs[3:]]:  # one burst: the deep row is in a batch
        await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue) as worker:
        await wait_for(lambda: _all(db_pool, jobs, ("succeeded", 1)), timeout=15)
        await wait_for(lambda: _all(db_pool, [deep], ("dead", 1)), timeout=15)
        await wait_for(lambda: _settled(worker, channel, queue), timeout=10)
    error = await db_pool.fetchval(  # not SELECT *: the test cannot read that payload either
        "SELECT last_error FROM duetime.jobs WHERE id = $1", deep.id
    )
    assert error.startswith("the worker cannot read this job's row: RecursionError"), error
    assert await effects(db_pool, deep, effects_table) == 0


async def test_pools_open_full_and_prepared_then_shrink_when_idle(
    settings: Settings,
    db_pool: asyncpg.Pool,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No cold start: at ready every handler connection exists with the worker's
    statements prepared. Idle connections are closed down to the warm ones (here after
    5 s instead of a minute), so an idle worker of concurrency 32 holds 6 connections,
    not 36. (5 s, not less: opening and preparing 36 connections takes over a second on
    a loaded 2-core box, and the first ones would be closed as idle before the check.)"""
    monkeypatch.setattr(shards, "IDLE_SECONDS", 5.0)
    name = f"duetime:{settings.node_id}"

    async def held() -> int:
        return await db_pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
        )

    async with running_worker(settings, Registry(), queue, concurrency=32) as worker:
        assert worker.pool is not None and worker.store_pool is not None
        assert worker.pool.get_size() == 32
        async with worker.pool.acquire() as conn:
            prepared = await conn.fetchval("SELECT count(*) FROM pg_prepared_statements")
        assert prepared >= 1
        async with worker.store_pool.acquire() as conn:
            prepared = await conn.fetchval("SELECT count(*) FROM pg_prepared_statements")
        assert prepared >= 5
        assert await held() >= 36
        await wait_for(lambda: _at_most(held, 6), timeout=30, message="idle pools shrink")
        assert worker.pool.get_size() == shards.HANDLER_WARM


async def _at_most(count: Any, limit: int) -> bool:
    return await count() <= limit


async def _all(pool: asyncpg.Pool, jobs: list[DispatchedJob], state: tuple[str, int]) -> bool:
    found = await _statuses(pool, jobs)
    return len(found) == len(jobs) and all(v == state for v in found.values())
