"""A slot is a running handler (issue 25 part 1; ``workers.slots``): what freeing a slot
at handler return must not change.

- Two jobs with the same idempotency key: the second is a duplicate (settled, its
  handler's ``ctx.db`` work never applied), never a failed attempt — at
  ``--concurrency 1``, where the second now begins before the first one's ledger row
  committed (the reverted first attempt failed here), at ``--concurrency`` > 1, and
  across two workers, where the second's handler loses to the first one's effect.
- A message is acked only after its outcome committed: ``kill -9`` between handler
  return and commit redelivers it, and its effect is applied once.
- A delivery takes its slot after its begin read: while it waits for one it heartbeats
  (the reconciler leaves it alone), and a cancel heard meanwhile, by NOTIFY or by the
  backstop check, keeps its handler from starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel
from prometheus_client import REGISTRY

from scheduler.config import Settings
from scheduler.store.jobs import JobStore
from tests.fixtures_tasks.basic import EFFECTS_TABLE
from tests.fixtures_tasks.jobs import (
    DispatchedJob,
    declare,
    dispatched_job,
    effects,
    job_row,
    publish,
    queue_depth,
)
from tests.support.helpers import declare_queues, delete_job_queue
from tests.support.procs import Processes, duetime_argv
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker
from workers.cancel import CHECK_INTERVAL

pytestmark = pytest.mark.timeout(90)

RECEIPTS = "slotfree_receipts"


@contextlib.asynccontextmanager
async def running(
    settings: Settings, registry: Registry, queue: str, *, concurrency: int
) -> AsyncIterator[Worker]:
    worker = Worker(
        dataclasses.replace(settings, node_id=f"{settings.node_id}-{queue}"),
        queues=[queue],
        registry=registry,
        concurrency=concurrency,
        grace_period=5,
    )
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


@contextlib.asynccontextmanager
async def row_locked(pool: asyncpg.Pool, job: DispatchedJob) -> AsyncIterator[None]:
    """Hold ``job``'s row FOR UPDATE: its outcome cannot commit meanwhile."""
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        try:
            await conn.execute(
                "SELECT 1 FROM duetime.jobs WHERE id = $1 AND due_at = $2 FOR UPDATE",
                job.id,
                job.due_at,
            )
            yield
        finally:
            await tx.rollback()


def receipt_registry(started: list[int], go: asyncio.Event) -> Registry:
    """``t.receipt``: records an effect, then a receipt unique per idempotency key (the
    business table's own guard, as in docs/api.md's worker example); the first job to
    start waits for ``go`` after writing."""
    registry = Registry()

    @registry.task("t.receipt")
    async def receipt(ctx: JobContext, payload: dict[str, Any]) -> None:
        started.append(ctx.job_id)
        await ctx.db.execute(
            f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, 'r')",
            ctx.job_id,
            ctx.attempt,
        )
        await ctx.db.execute(
            f"INSERT INTO {RECEIPTS} (key, job_id) VALUES ($1, $2)",
            ctx.idempotency_key,
            ctx.job_id,
        )
        if len(started) == 1:
            await go.wait()

    return registry


@pytest.fixture
async def receipts(db_pool: asyncpg.Pool) -> str:
    await db_pool.execute(
        f"CREATE TABLE IF NOT EXISTS {RECEIPTS} (key text PRIMARY KEY, job_id bigint NOT NULL)"
    )
    return RECEIPTS


async def settled_once(pool: asyncpg.Pool, first: DispatchedJob, second: DispatchedJob) -> None:
    """The first applied the effect; the second was settled as a duplicate at attempt 1
    (never failed, never retried), its ctx.db work absent."""
    for job in (first, second):
        await wait_for(
            lambda j=job: _status(pool, j, "succeeded"), timeout=20, message=f"job {job.id}"
        )
    row = await job_row(pool, second)
    assert (row["attempt"], row["last_error"]) == (1, None), dict(row)
    assert await effects(pool, first, EFFECTS_TABLE) == 1
    assert await effects(pool, second, EFFECTS_TABLE) == 0
    assert await pool.fetchval(
        f"SELECT array_agg(job_id) FROM {RECEIPTS} WHERE key = $1", first.key
    ) == [first.id]
    ledger = await pool.fetch(
        "SELECT job_id FROM duetime.job_ledger WHERE idempotency_key = $1", first.key
    )
    assert [r["job_id"] for r in ledger] == [first.id]


async def _status(pool: asyncpg.Pool, job: DispatchedJob, status: str) -> bool:
    return (await job_row(pool, job))["status"] == status


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_a_second_job_with_the_same_key_is_a_duplicate_not_a_failure(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
    receipts: str,
    concurrency: int,
) -> None:
    """The first job's outcome is held (its row locked) after its handler returned, so
    its slot is free and its ledger row uncommitted when the second job begins. The
    second waits for the first's commit, then finds the key in the ledger: a duplicate,
    its handler never run. (The reverted freed slot ran it: its receipt insert waited on
    the first's, failed with a unique violation once that committed, and the attempt was
    retried.)"""
    started: list[int] = []
    go = asyncio.Event()
    registry = receipt_registry(started, go)
    key = f"order:{unique}"
    first = await dispatched_job(db_pool, "t.receipt", queue=queue, idempotency_key=key)
    second = await dispatched_job(db_pool, "t.receipt", queue=queue, idempotency_key=key)
    async with running(settings, registry, queue, concurrency=concurrency):
        await publish(channel, queue, first.message(1))
        await wait_for(lambda: started == [first.id], timeout=10)
        async with row_locked(db_pool, first):
            go.set()  # the first handler returns; its finish waits for the row
            await publish(channel, queue, second.message(1))
            await asyncio.sleep(1.0)  # the second begins (and, freed too early, ran)
            assert (await job_row(db_pool, first))["status"] == "dispatched"
        await settled_once(db_pool, first, second)
        assert started == [first.id]  # the duplicate's handler never ran
        assert await queue_depth(channel, queue) == (0, 1)


async def test_a_failure_that_lost_to_another_holder_of_its_key_is_a_duplicate(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
    receipts: str,
) -> None:
    """Across two workers nothing orders the two jobs: the second's handler runs while
    the first's is uncommitted, its receipt insert waits on the first's and fails with a
    unique violation when the first commits. That failure lost to a concurrent holder
    of its key: the ledger holds the key now, so it is settled as a duplicate (its
    effects rolled back), not retried."""
    other = f"q2-{unique}"
    await declare_queues(db_pool, other)
    await declare(channel, other)
    started: list[int] = []
    go = asyncio.Event()
    registry = receipt_registry(started, go)
    key = f"order:{unique}"
    first = await dispatched_job(db_pool, "t.receipt", queue=queue, idempotency_key=key)
    second = await dispatched_job(db_pool, "t.receipt", queue=other, idempotency_key=key)
    try:
        async with (
            running(settings, registry, queue, concurrency=1),
            running(settings, registry, other, concurrency=1),
        ):
            await publish(channel, queue, first.message(1))
            await wait_for(lambda: started == [first.id], timeout=10)
            await publish(channel, other, second.message(1))
            await wait_for(lambda: started == [first.id, second.id], timeout=10)
            await asyncio.sleep(0.3)  # the second's receipt insert waits on the first's
            go.set()
            await settled_once(db_pool, first, second)
    finally:
        with contextlib.suppress(Exception):
            await delete_job_queue(channel, other)


async def test_kill9_between_handler_return_and_commit_redelivers_effect_once(
    procs: Processes,
    test_env: dict[str, str],
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
    tmp_path: Path,
) -> None:
    """A worker process at --concurrency 1: the first job's handler returned and its
    outcome cannot commit (the test holds its row). Its slot is free — a second job runs
    and succeeds meanwhile — but its message is not acked: killed with -9 there, the
    message goes back to the queue, another worker runs it, and its effect is applied
    once (the killed attempt's transaction rolled back)."""
    hold = tmp_path / "hold"
    hold.touch()
    first = await dispatched_job(
        db_pool, "fixtures.record", {"beat": True, "hold_while_exists": str(hold)}, queue=queue
    )
    second = await dispatched_job(db_pool, "fixtures.record", {}, queue=queue)
    argv = duetime_argv(
        "worker", "--import", "tests.fixtures_tasks.basic", "--queue", queue,
        "--concurrency", "1", "--grace-period", "1",
    )  # fmt: skip
    env = {**test_env, "DUETIME_LOG_LEVEL": "info"}
    a = procs.spawn(argv, name="worker-a", env={**env, "DUETIME_NODE_ID": f"a-{unique}"})
    await wait_for(lambda: _consumers(channel, queue, 1), timeout=20, message=a.tail())
    await publish(channel, queue, first.message(1))

    async def heartbeated() -> bool:  # the handler runs, its effect inserted, uncommitted
        return (await job_row(db_pool, first))["heartbeat_at"] is not None

    await wait_for(heartbeated, timeout=15, message=a.tail())
    async with row_locked(db_pool, first):
        hold.unlink()  # the handler returns; its finish_attempt waits for the row
        await publish(channel, queue, second.message(1))
        await wait_for(lambda: _status(db_pool, second, "succeeded"), timeout=15, message=a.tail())
        assert (await job_row(db_pool, first))["status"] == "dispatched"
        a.kill9()
        # the unacked message is back in the queue (not acked before its commit)
        await wait_for(
            lambda: _ready(channel, queue, 1), timeout=15, message="first's message requeued"
        )
        await asyncio.sleep(2.5)  # the server notices the dead client (1 s check) and aborts
    b = procs.spawn(argv, name="worker-b", env={**env, "DUETIME_NODE_ID": f"b-{unique}"})
    await wait_for(lambda: _status(db_pool, first, "succeeded"), timeout=20, message=b.tail())
    assert await effects(db_pool, first, EFFECTS_TABLE) == 1
    assert await effects(db_pool, second, EFFECTS_TABLE) == 1
    ledger = await db_pool.fetchrow(
        "SELECT worker, attempt FROM duetime.job_ledger WHERE idempotency_key = $1", first.key
    )
    assert dict(ledger) == {"worker": f"b-{unique}", "attempt": 1}
    assert await b.stop(timeout=15) == 0
    assert await queue_depth(channel, queue) == (0, 0)


async def _consumers(channel: AbstractChannel, queue: str, count: int) -> bool:
    return (await queue_depth(channel, queue))[1] == count


async def _ready(channel: AbstractChannel, queue: str, count: int) -> bool:
    return (await queue_depth(channel, queue))[0] == count


def _one_at_a_time(started: list[int], go: asyncio.Event) -> Registry:
    """``t.turns``: records its start; the first job to start waits for ``go``."""
    registry = Registry()

    @registry.task("t.turns")
    async def turns(ctx: JobContext, payload: dict[str, Any]) -> None:
        started.append(ctx.job_id)
        if len(started) == 1:
            await go.wait()

    return registry


async def test_a_delivery_waiting_for_a_slot_heartbeats_and_a_cancel_keeps_it_from_starting(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    """``--concurrency 1``: the first job runs; the second is begun and waits for the
    slot. Its heartbeat moves while it waits (heartbeat interval 0.5 s), so the
    reconciler does not take it for a lost delivery; cancelled then, it never starts
    once the slot frees, and its message is acked."""
    started: list[int] = []
    go = asyncio.Event()
    first = await dispatched_job(db_pool, "t.turns", queue=queue)
    second = await dispatched_job(db_pool, "t.turns", queue=queue)
    quick = dataclasses.replace(settings, visibility_timeout=1.5)
    async with running(quick, _one_at_a_time(started, go), queue, concurrency=1) as worker:
        await publish(channel, queue, first.message(1))
        await wait_for(lambda: started == [first.id], timeout=10)
        dispatched_beat = (await job_row(db_pool, second))["heartbeat_at"]
        await publish(channel, queue, second.message(1))

        async def beating() -> bool:
            beat = (await job_row(db_pool, second))["heartbeat_at"]
            return beat is not None and (dispatched_beat is None or beat > dispatched_beat)

        await wait_for(beating, timeout=10, message="the waiting delivery's heartbeat")
        assert REGISTRY.get_sample_value("duetime_worker_deliveries_waiting") == 1
        assert REGISTRY.get_sample_value("duetime_worker_handlers_running") == 1
        cancelled = await JobStore(db_pool).cancel(second.id, by="tester")
        assert cancelled.status == "cancelled"
        await asyncio.sleep(0.5)  # the NOTIFY reaches the worker
        go.set()
        await wait_for(lambda: _status(db_pool, first, "succeeded"), timeout=10)
        assert worker.consumer is not None
        await wait_for(lambda: worker.consumer.in_flight == 0, timeout=10)
    assert started == [first.id]
    assert (await job_row(db_pool, second))["status"] == "cancelled"
    assert await queue_depth(channel, queue) == (0, 0)


async def test_a_cancel_without_notify_is_found_for_a_delivery_waiting_for_a_slot(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    """The second job is cancelled by plain SQL (no NOTIFY, as when the LISTEN
    connection was down) while it waits for the slot: the backstop check asks about
    waiting deliveries too, and its handler never starts."""
    started: list[int] = []
    go = asyncio.Event()
    first = await dispatched_job(db_pool, "t.turns", queue=queue)
    second = await dispatched_job(db_pool, "t.turns", queue=queue)
    async with running(settings, _one_at_a_time(started, go), queue, concurrency=1) as worker:
        await publish(channel, queue, first.message(1))
        await wait_for(lambda: started == [first.id], timeout=10)
        await publish(channel, queue, second.message(1))
        await wait_for(lambda: _ready(channel, queue, 0), timeout=10)  # delivered to us
        await asyncio.sleep(0.5)  # its begin read saw it dispatched
        await db_pool.execute(
            "UPDATE duetime.jobs SET status = 'cancelled', finished_at = now() WHERE id = $1",
            second.id,
        )
        await asyncio.sleep(CHECK_INTERVAL + 1.5)  # one backstop check
        go.set()
        assert worker.consumer is not None
        await wait_for(lambda: worker.consumer.in_flight == 0, timeout=10)
    assert started == [first.id]
    assert await queue_depth(channel, queue) == (0, 0)
