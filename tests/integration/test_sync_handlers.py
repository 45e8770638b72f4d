"""Plain ``def`` handlers (workers/threads.py, workers/sync_db.py) in a real worker,
against real PostgreSQL and RabbitMQ: they run on handler threads, their synchronous
``ctx.db`` is the attempt's transaction (committed with the ledger row, rolled back on
failure), and a timed-out thread is abandoned: its slot is freed, its later ``ctx.db``
calls fail, and the worker asks to be restarted past ``worker_max_abandoned_threads``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel
from prometheus_client import REGISTRY

from scheduler.config import Settings
from tests.fixtures_tasks.basic import EFFECTS_TABLE
from tests.fixtures_tasks.jobs import dispatched_job, effects, job_row, publish, redispatch
from tests.support.helpers import running_worker
from tests.support.wait import wait_for
from workers import Registry, Retry, SyncJobContext, Worker
from workers.sync_db import AttemptAbandoned

pytestmark = pytest.mark.timeout(60)

INSERT = f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, $3)"


async def _status(pool: asyncpg.Pool, job: Any) -> tuple[str, int]:
    row = await job_row(pool, job)
    return row["status"], row["attempt"]


async def test_a_plain_def_handler_writes_in_the_attempts_transaction_off_the_loop(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """Its ctx.db statements commit with the ledger row and the succeeded status; it runs
    on a handler thread, not the loop's; heartbeat works from the thread; a failing
    attempt's write is rolled back with it and the retry runs it once."""
    registry = Registry()
    seen: list[tuple[str, bool, int]] = []
    loop_thread = threading.get_ident()

    @registry.task("t.sync")
    def sync(ctx: SyncJobContext, payload: dict[str, Any]) -> None:
        ctx.db.execute(INSERT, ctx.job_id, ctx.attempt, payload["tag"])
        mine = ctx.db.fetchval(
            f"SELECT count(*) FROM {EFFECTS_TABLE} WHERE job_id = $1", ctx.job_id
        )
        seen.append((threading.current_thread().name, ctx.heartbeat(), mine))
        assert threading.get_ident() != loop_thread
        if payload.get("fail_first") and ctx.attempt == 1:
            raise Retry(in_=0.05)

    ok = await dispatched_job(db_pool, "t.sync", {"tag": "ok"}, queue=queue)
    flaky = await dispatched_job(db_pool, "t.sync", {"tag": "f", "fail_first": True}, queue=queue)
    async with running_worker(settings, registry, queue) as worker:
        await publish(channel, queue, ok.message())
        await publish(channel, queue, flaky.message())
        await wait_for(
            lambda: _eq(_status(db_pool, ok), ("succeeded", 1)), timeout=10, message="ok"
        )
        await wait_for(lambda: _eq(_status(db_pool, flaky), ("pending", 2)), timeout=10)
        await publish(channel, queue, flaky.message(await redispatch(db_pool, flaky)))
        await wait_for(lambda: _eq(_status(db_pool, flaky), ("succeeded", 2)), timeout=10)
        assert worker.thread_runner is not None and worker.thread_runner.abandoned == 0
    assert await effects(db_pool, ok, effects_table) == 1
    # attempt 1's write rolled back with it: one row, attempt 2's
    rows = await db_pool.fetch(f"SELECT attempt FROM {EFFECTS_TABLE} WHERE job_id = $1", flaky.id)
    assert [r["attempt"] for r in rows] == [2]
    assert all(name.startswith("duetime-handler-") and beat for name, beat, _ in seen)
    assert all(mine == 1 for _, _, mine in seen)  # each saw its own uncommitted write
    for job in (ok, flaky):
        assert (
            await db_pool.fetchval(
                "SELECT count(*) FROM duetime.job_ledger WHERE job_id = $1", job.id
            )
            == 1
        )


async def _eq(got: Any, want: Any) -> bool:
    return bool(await got == want)


async def test_a_timed_out_thread_is_abandoned_its_slot_freed_and_its_ctx_closed(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """One handler thread. A handler writes, then blocks past its timeout: the attempt is
    settled as failed (its write rolled back), the next job runs meanwhile on a
    replacement thread, and once released the stuck thread's ctx.db call raises
    ``AttemptAbandoned`` and writes nothing. With ``worker_max_abandoned_threads=0`` the
    worker asks to be restarted."""
    registry = Registry()
    release = threading.Event()
    late: list[BaseException] = []

    @registry.task("t.stuck", timeout=0.5)
    def stuck(ctx: SyncJobContext, payload: dict[str, Any]) -> None:
        ctx.db.execute(INSERT, ctx.job_id, ctx.attempt, "before")
        release.wait(20)
        try:
            ctx.db.execute(INSERT, ctx.job_id, ctx.attempt, "after")
        except BaseException as exc:
            late.append(exc)
            raise

    @registry.task("t.quick")
    def quick(ctx: SyncJobContext, payload: dict[str, Any]) -> None:
        ctx.db.execute(INSERT, ctx.job_id, ctx.attempt, "quick")

    strict = dataclasses.replace(settings, worker_max_abandoned_threads=0)
    blocked = await dispatched_job(db_pool, "t.stuck", queue=queue)
    after = await dispatched_job(db_pool, "t.quick", queue=queue)
    total = REGISTRY.get_sample_value("duetime_worker_threads_abandoned_total") or 0.0
    worker = Worker(strict, queues=[queue], registry=registry, concurrency=4, threads=1)
    await worker.start()
    try:
        await publish(channel, queue, blocked.message())
        await wait_for(lambda: _eq(_status(db_pool, blocked), ("pending", 2)), timeout=10)
        row = await job_row(db_pool, blocked)
        assert "exceeded its timeout of 0.5s" in row["last_error"]
        runner = worker.thread_runner
        assert runner is not None and runner.abandoned == 1
        assert REGISTRY.get_sample_value("duetime_worker_abandoned_threads") == 1
        assert REGISTRY.get_sample_value("duetime_worker_threads_abandoned_total") == total + 1
        assert worker.restart_requested.is_set()  # 1 > max 0
        # the slot is free although the only thread is still blocked
        await publish(channel, queue, after.message())
        await wait_for(lambda: _eq(_status(db_pool, after), ("succeeded", 1)), timeout=10)
        release.set()
        await wait_for(lambda: runner.abandoned == 0, timeout=10, message="thread ended")
        assert REGISTRY.get_sample_value("duetime_worker_abandoned_threads") == 0
    finally:
        release.set()
        await worker.stop()
    assert len(late) == 1 and isinstance(late[0], AttemptAbandoned)
    assert await effects(db_pool, blocked, effects_table) == 0
    assert await effects(db_pool, after, effects_table) == 1
