"""Worker execution against real PostgreSQL and RabbitMQ, in-process (DESIGN §1.2, §6).

Each test plays the dispatcher by hand (``tests.fixtures_tasks.jobs``): it makes a job
``dispatched`` and publishes its contract message to a queue of its own, runs a
``Worker`` with a registry of its own, and asserts on the job row, the ledger, the
handler's effects and the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from prometheus_client import REGISTRY

from scheduler.broker import DEAD_LETTER_EXCHANGE, declare_dead_letter, queue_name
from scheduler.config import Settings
from tests.fixtures_tasks.basic import EFFECTS_TABLE
from tests.fixtures_tasks.jobs import (
    FENCE_EPOCH,
    DispatchedJob,
    dispatched_job,
    effects,
    job_row,
    publish,
    queue_depth,
    redispatch,
)
from tests.support.proxy import FaultProxy
from tests.support.wait import wait_for
from workers import Fail, JobContext, Registry, Retry, RetryPolicy, Snooze, Worker

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def running(
    settings: Settings,
    registry: Registry,
    queue: str,
    *,
    concurrency: int = 4,
    grace: float = 5.0,
    **overrides: Any,
) -> AsyncIterator[Worker]:
    worker = Worker(
        dataclasses.replace(settings, **overrides),
        queues=[queue],
        registry=registry,
        concurrency=concurrency,
        grace_period=grace,
    )
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def status_is(pool: asyncpg.Pool, job: DispatchedJob, status: str, attempt: int) -> bool:
    row = await job_row(pool, job)
    return row["status"] == status and row["attempt"] == attempt


def recording_registry(name: str = "t.record", **options: Any) -> Registry:
    registry = Registry()

    @registry.task(name, **options)
    async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
        await ctx.db.execute(
            f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, $3)",
            ctx.job_id,
            ctx.attempt,
            payload.get("tag"),
        )
        await asyncio.sleep(float(payload.get("sleep", 0)))

    return registry


async def test_success_commits_effect_ledger_and_status_then_acks(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    registry = recording_registry()
    job = await dispatched_job(db_pool, "t.record", {"tag": "a"}, queue=queue)
    async with running(settings, registry, queue):
        await publish(channel, queue, job.message(1))
        await wait_for(lambda: status_is(db_pool, job, "succeeded", 1), timeout=10)
    row = await job_row(db_pool, job)
    assert row["finished_at"] is not None and row["last_error"] is None
    ledger = await db_pool.fetchrow(
        "SELECT * FROM duetime.job_ledger WHERE idempotency_key = $1", job.key
    )
    assert ledger["job_id"] == job.id and ledger["attempt"] == 1
    assert ledger["worker"] == settings.node_id and ledger["task"] == "t.record"
    assert await effects(db_pool, job, effects_table) == 1
    assert await queue_depth(channel, queue) == (0, 0)


async def test_duplicate_delivery_applies_the_effect_once(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    registry = recording_registry()
    concurrent = await dispatched_job(db_pool, "t.record", {"sleep": 0.3}, queue=queue)
    later = await dispatched_job(db_pool, "t.record", {}, queue=queue)
    # Two copies in the queue before the worker starts: they run side by side, the second
    # blocks on the ledger key until the first commits, then finds the effect done.
    await publish(channel, queue, concurrent.message(1))
    await publish(channel, queue, concurrent.message(1))
    async with running(settings, registry, queue, concurrency=4) as worker:
        await publish(channel, queue, later.message(1))
        await wait_for(lambda: status_is(db_pool, later, "succeeded", 1), timeout=10)
        await publish(channel, queue, later.message(1))  # a redelivery after success
        await wait_for(lambda: status_is(db_pool, concurrent, "succeeded", 1), timeout=10)
        await wait_for(lambda: _idle(worker, channel, queue), timeout=10)
    assert await effects(db_pool, concurrent, effects_table) == 1
    assert await effects(db_pool, later, effects_table) == 1
    assert await queue_depth(channel, queue) == (0, 0)  # both copies acked, none requeued


async def _idle(worker: Worker, channel: AbstractChannel, queue: str) -> bool:
    """Nothing ready in the queue and nothing in flight in the worker: all settled."""
    assert worker.consumer is not None
    return await _ready_is(channel, queue, 0) and worker.consumer.in_flight == 0


async def test_failures_retry_with_growing_delays_then_dead(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    registry = Registry()

    @registry.task("t.fail", retry=RetryPolicy(base=30.0, factor=2.0, jitter=False))
    async def fail(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise ValueError(f"boom {ctx.attempt}")

    job = await dispatched_job(db_pool, "t.fail", queue=queue, max_attempts=3)
    async with running(settings, registry, queue):
        await publish(channel, queue, job.message(1))
        await wait_for(lambda: status_is(db_pool, job, "pending", 2), timeout=10)
        first = await job_row(db_pool, job)
        assert 27.0 < first["run_in"] <= 30.0
        assert first["last_error"] == "ValueError: boom 1"
        assert first["dispatched_at"] is None and first["finished_at"] is None

        await publish(channel, queue, job.message(await redispatch(db_pool, job)))
        await wait_for(lambda: status_is(db_pool, job, "pending", 3), timeout=10)
        second = await job_row(db_pool, job)
        assert 57.0 < second["run_in"] <= 60.0  # the delay grew: 30 s, then 60 s
        assert second["run_at"] > first["run_at"]

        await publish(channel, queue, job.message(await redispatch(db_pool, job)))
        await wait_for(lambda: status_is(db_pool, job, "dead", 3), timeout=10)
    dead = await job_row(db_pool, job)
    assert dead["last_error"] == "ValueError: boom 3" and dead["finished_at"] is not None
    assert (
        await db_pool.fetchval("SELECT count(*) FROM duetime.job_ledger WHERE job_id = $1", job.id)
        == 0
    )
    assert await queue_depth(channel, queue) == (0, 0)


async def test_retry_asks_for_a_delay_and_counts_an_attempt_and_fail_is_final(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    registry = Registry()

    @registry.task("t.retry")
    async def again(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise Retry(in_=7)

    @registry.task("t.give_up")
    async def give_up(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise Fail("bad payload")

    retried = await dispatched_job(db_pool, "t.retry", queue=queue, max_attempts=2)
    failed = await dispatched_job(db_pool, "t.give_up", queue=queue, max_attempts=5)
    async with running(settings, registry, queue):
        await publish(channel, queue, retried.message(1))
        await publish(channel, queue, failed.message(1))
        await wait_for(lambda: status_is(db_pool, retried, "pending", 2), timeout=10)
        row = await job_row(db_pool, retried)
        assert 5.0 < row["run_in"] <= 7.0
        assert row["last_error"] == "Retry: retry requested in 7s"
        # the last attempt asking for a retry ends dead: Retry counts against the budget
        await publish(channel, queue, retried.message(await redispatch(db_pool, retried)))
        await wait_for(lambda: status_is(db_pool, retried, "dead", 2), timeout=10)
        await wait_for(lambda: status_is(db_pool, failed, "dead", 1), timeout=10)
    assert (await job_row(db_pool, failed))["last_error"] == "Fail: bad payload"


async def test_timeout_rolls_back_partial_writes_and_retries(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    registry = recording_registry("t.slow", timeout=0.3)
    job = await dispatched_job(db_pool, "t.slow", {"sleep": 10}, queue=queue)
    async with running(settings, registry, queue):
        await publish(channel, queue, job.message(1))
        await wait_for(lambda: status_is(db_pool, job, "pending", 2), timeout=10)
    row = await job_row(db_pool, job)
    assert row["last_error"] == "TimeoutError: handler exceeded its timeout of 0.3s"
    assert await effects(db_pool, job, effects_table) == 0  # the INSERT before the sleep


async def test_unknown_task_is_retried_then_dead_with_the_registered_names(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    """A rolling deploy: a worker that does not know a task yet must not kill its jobs.
    The attempt counts (retried with back-off, the error names this worker's tasks), and
    the job is dead only when its attempts are spent."""
    registry = recording_registry("t.b")
    registry.register("t.a", registry.get("t.b").handler)  # type: ignore[union-attr]
    retried = await dispatched_job(db_pool, "t.nope", queue=queue, max_attempts=3)
    last = await dispatched_job(db_pool, "t.nope", queue=queue, max_attempts=1)
    async with running(settings, registry, queue):
        await publish(channel, queue, retried.message(1))
        await publish(channel, queue, last.message(1))
        await wait_for(lambda: status_is(db_pool, retried, "pending", 2), timeout=10)
        await wait_for(lambda: status_is(db_pool, last, "dead", 1), timeout=10)
    for job in (retried, last):
        row = await job_row(db_pool, job)
        assert row["last_error"] == "unknown task 't.nope' (registered: t.a, t.b)"
    assert (await job_row(db_pool, retried))["run_at"] > (await job_row(db_pool, retried))["due_at"]
    assert await queue_depth(channel, queue) == (0, 0)


async def test_malformed_and_incomplete_messages_are_dead_lettered(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
    effects_table: str,
) -> None:
    # A private queue bound to the fanout DLX sees every dead-lettered message without
    # taking anything from the shared duetime.dead-letter queue; we look for our ids.
    await declare_dead_letter(channel)
    tap = await channel.declare_queue("", exclusive=True, auto_delete=True)
    await tap.bind(DEAD_LETTER_EXCHANGE)
    before = REGISTRY.get_sample_value("duetime_malformed_messages_total") or 0.0
    ids = {f"bad-json-{unique}", f"missing-{unique}", f"wrong-type-{unique}"}
    registry = recording_registry()
    ok = await dispatched_job(db_pool, "t.record", queue=queue)
    async with running(settings, registry, queue):
        await publish(channel, queue, b"{not json", message_id=f"bad-json-{unique}")
        await publish(
            channel, queue, b'{"job_id": 1, "task": "t.record"}', message_id=f"missing-{unique}"
        )
        await publish(
            channel,
            queue,
            ok.message(1).encode().replace(b'"attempt":1', b'"attempt":"1"'),
            message_id=f"wrong-type-{unique}",
        )
        seen: dict[str, AbstractIncomingMessage] = {}

        async def all_dead_lettered() -> bool:
            while (message := await tap.get(no_ack=True, fail=False, timeout=5)) is not None:
                if message.message_id in ids:
                    seen[message.message_id] = message
            return set(seen) == ids

        await wait_for(all_dead_lettered, timeout=15)
        # the consumer is alive and well after them
        await publish(channel, queue, ok.message(1))
        await wait_for(lambda: status_is(db_pool, ok, "succeeded", 1), timeout=10)
    for message in seen.values():
        death = message.headers["x-death"][0]  # type: ignore[index]
        assert death["queue"] == queue_name(queue) and death["reason"] == "rejected"
    after = REGISTRY.get_sample_value("duetime_malformed_messages_total") or 0.0
    assert after - before == 3
    assert await queue_depth(channel, queue) == (0, 0)


async def test_stale_deliveries_are_acked_and_change_nothing(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    registry = recording_registry()
    job = await dispatched_job(db_pool, "t.record", queue=queue)
    await db_pool.execute(
        "UPDATE duetime.jobs SET status = 'cancelled' WHERE id = $1 AND due_at = $2",
        job.id,
        job.due_at,
    )
    other = await dispatched_job(db_pool, "t.record", queue=queue)
    async with running(settings, registry, queue) as worker:
        await publish(channel, queue, job.message(1))  # cancelled meanwhile
        await publish(channel, queue, other.message(2))  # an attempt that is not current
        missing = dataclasses.replace(other, id=other.id + 10_000_000)
        await publish(channel, queue, missing.message(1))  # no such row
        await wait_for(lambda: _idle(worker, channel, queue), timeout=10)
    assert await queue_depth(channel, queue) == (0, 0)
    assert (await job_row(db_pool, job))["status"] == "cancelled"
    assert (await job_row(db_pool, other))["status"] == "dispatched"
    assert await effects(db_pool, job, effects_table) == 0
    assert await effects(db_pool, other, effects_table) == 0
    # the lock-read and the ledger insert are one statement: a stale delivery inserts nothing
    assert not await db_pool.fetchval(
        "SELECT count(*) FROM duetime.job_ledger WHERE job_id = ANY($1::bigint[])",
        [job.id, other.id, missing.id],
    )


async def test_the_rows_own_key_is_the_ledger_key_and_dedupes_across_jobs(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """The key comes from the locked row (the message's is only the fallback): two jobs a
    producer gave the same key run once; the second is settled as already done. The
    ledger key is the producer's key scoped by the inserting role (migration 0007)."""
    registry = recording_registry()
    seen: list[str] = []

    @registry.task("t.key")
    async def keyed(ctx: JobContext, payload: dict[str, Any]) -> None:
        seen.append(ctx.idempotency_key)
        await ctx.db.execute(
            f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, 'k')",
            ctx.job_id,
            ctx.attempt,
        )

    key = f"order:{queue}"
    first = await dispatched_job(db_pool, "t.key", queue=queue, idempotency_key=key)
    second = await dispatched_job(db_pool, "t.key", queue=queue, idempotency_key=key)
    async with running(settings, registry, queue, concurrency=1):
        # a message carrying another key (an older producer's, say) changes nothing
        await publish(channel, queue, dataclasses.replace(first, key="stale:key").message(1))
        await wait_for(lambda: status_is(db_pool, first, "succeeded", 1), timeout=10)
        await publish(channel, queue, second.message(1))
        await wait_for(lambda: status_is(db_pool, second, "succeeded", 1), timeout=10)
    assert seen == [first.key] and first.key == second.key and first.key.endswith(f":{key}")
    ledger = await db_pool.fetch(
        "SELECT idempotency_key, job_id FROM duetime.job_ledger WHERE job_id = ANY($1::bigint[])",
        [first.id, second.id],
    )
    assert [(r["idempotency_key"], r["job_id"]) for r in ledger] == [(first.key, first.id)]
    assert await effects(db_pool, first, effects_table) == 1
    assert await effects(db_pool, second, effects_table) == 0


async def _ready_is(channel: AbstractChannel, queue: str, count: int) -> bool:
    return (await queue_depth(channel, queue))[0] == count


async def test_message_before_claim_commit_waits_for_the_claim(
    settings: Settings,
    db_pool: asyncpg.Pool,
    dsn: str,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """The dispatcher publishes inside its claim transaction: the worker's FOR KEY SHARE
    waits for it, then runs the job if the claim committed, skips it if it rolled back."""
    registry = recording_registry()
    committed = await dispatched_job(db_pool, "t.record", queue=queue)
    rolled_back = await dispatched_job(db_pool, "t.record", queue=queue)
    await db_pool.execute(
        "UPDATE duetime.jobs SET status = 'pending' WHERE id = ANY($1::bigint[])",
        [committed.id, rolled_back.id],
    )
    claimer = await asyncpg.connect(dsn)
    try:
        async with running(settings, registry, queue) as worker:
            for job, outcome in ((committed, "commit"), (rolled_back, "rollback")):
                tx = claimer.transaction()
                await tx.start()
                await claimer.execute(
                    "SELECT 1 FROM duetime.jobs WHERE id = $1 AND due_at = $2 FOR UPDATE",
                    job.id,
                    job.due_at,
                )
                await claimer.execute(
                    "UPDATE duetime.jobs SET status = 'dispatched', "
                    f"dispatch_epoch = {FENCE_EPOCH} WHERE id = $1",
                    job.id,
                )
                await publish(channel, queue, job.message(1))
                await wait_for(lambda: _worker_waits_on_lock(db_pool, settings), timeout=10)
                await (tx.commit() if outcome == "commit" else tx.rollback())
            await wait_for(lambda: status_is(db_pool, committed, "succeeded", 1), timeout=10)
            await wait_for(lambda: _idle(worker, channel, queue), timeout=10)
    finally:
        await claimer.close()
    assert (await job_row(db_pool, rolled_back))["status"] == "pending"
    assert await effects(db_pool, committed, effects_table) == 1
    assert await effects(db_pool, rolled_back, effects_table) == 0


async def _worker_waits_on_lock(pool: asyncpg.Pool, settings: Settings) -> bool:
    return bool(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
            "AND wait_event_type = 'Lock'",
            f"duetime:{settings.node_id}"[:63],
        )
    )


async def test_concurrency_is_bounded_in_handlers(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    registry = Registry()
    now_running = 0
    peak = 0

    @registry.task("t.count")
    async def count(ctx: JobContext, payload: dict[str, Any]) -> None:
        nonlocal now_running, peak
        now_running += 1
        peak = max(peak, now_running)
        try:
            await asyncio.sleep(0.15)
        finally:
            now_running -= 1

    jobs = [await dispatched_job(db_pool, "t.count", queue=queue) for _ in range(12)]
    for job in jobs:
        await publish(channel, queue, job.message(1))
    async with running(settings, registry, queue, concurrency=3) as worker:
        for job in jobs:
            await wait_for(lambda j=job: status_is(db_pool, j, "succeeded", 1), timeout=15)
        assert worker.consumer is not None and worker.consumer.peak == 3
    assert peak == 3


async def test_a_slot_is_free_once_its_handler_returned(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    """At concurrency 1, the next handler starts while the first one's outcome is still
    being settled (its row held by another transaction): the slot bounds running
    handlers, not settlements. The first is acked only after its outcome committed."""
    registry = Registry()
    started: list[str] = []
    go = asyncio.Event()

    @registry.task("t.slot")
    async def slot(ctx: JobContext, payload: dict[str, Any]) -> None:
        started.append(payload["name"])
        if payload["name"] == "first":
            await go.wait()

    first = await dispatched_job(db_pool, "t.slot", {"name": "first"}, queue=queue)
    second = await dispatched_job(db_pool, "t.slot", {"name": "second"}, queue=queue)
    async with running(settings, registry, queue, concurrency=1) as worker:
        await publish(channel, queue, first.message(1))
        await wait_for(lambda: started == ["first"], timeout=10)
        async with db_pool.acquire() as conn:
            lock = conn.transaction()
            await lock.start()
            try:  # the first one's outcome cannot commit while this holds its row
                await conn.execute("SELECT 1 FROM duetime.jobs WHERE id = $1 FOR UPDATE", first.id)
                go.set()
                await publish(channel, queue, second.message(1))
                await wait_for(lambda: started == ["first", "second"], timeout=10)
                assert worker.consumer is not None and worker.consumer.peak == 1
                assert (await job_row(db_pool, first))["status"] == "dispatched"
            finally:
                await lock.rollback()
        for job in (first, second):
            await wait_for(lambda j=job: status_is(db_pool, j, "succeeded", 1), timeout=15)
    assert await queue_depth(channel, queue) == (0, 0)


async def test_long_handler_heartbeats(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    registry = Registry()
    beats: list[bool] = []
    release = asyncio.Event()

    @registry.task("t.long")
    async def long(ctx: JobContext, payload: dict[str, Any]) -> None:
        beats.append(await ctx.heartbeat())
        await release.wait()

    job = await dispatched_job(db_pool, "t.long", queue=queue)
    # visibility 1.5 s: the automatic heartbeat comes every 0.5 s while the handler runs
    async with running(settings, registry, queue, visibility_timeout=1.5):
        await publish(channel, queue, job.message(1))
        await wait_for(lambda: beats, timeout=10)
        first = (await job_row(db_pool, job))["heartbeat_at"]
        assert first is not None

        async def beat_again() -> bool:
            return (await job_row(db_pool, job))["heartbeat_at"] > first

        await wait_for(beat_again, timeout=5)  # automatic, while the handler still runs
        release.set()
        await wait_for(lambda: status_is(db_pool, job, "succeeded", 1), timeout=10)
    assert beats == [True]


async def test_grace_period_expiry_rolls_back_and_requeues(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    registry = recording_registry()
    job = await dispatched_job(db_pool, "t.record", {"sleep": 30}, queue=queue)
    worker = Worker(settings, queues=[queue], registry=registry, concurrency=2)
    await worker.start()
    try:
        await publish(channel, queue, job.message(1))
        await wait_for(
            lambda: worker.consumer is not None and worker.consumer.active == 1, timeout=10
        )
    finally:
        await asyncio.wait_for(worker.stop(grace_period=0.3), 10)

    # back in the queue, nobody consuming: the broker settles the nack and drops the
    # cancelled consumer asynchronously, so wait (bounded) rather than sample once
    async def requeued() -> bool:
        return await queue_depth(channel, queue) == (1, 0)

    await wait_for(requeued, timeout=10, message="message requeued, consumer gone")
    row = await job_row(db_pool, job)
    assert row["status"] == "dispatched" and row["attempt"] == 1
    assert await effects(db_pool, job, effects_table) == 0


def awaiting_database() -> float | None:
    return REGISTRY.get_sample_value(
        "duetime_worker_deliveries_awaiting_database", {"shard": "main"}
    )


async def test_database_outage_holds_deliveries_until_the_database_answers(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """Deliveries that cannot reach the database are neither acked nor lost nor
    redelivered in a loop: each holds its message until the database answers, then goes
    back to the queue at once (workers/outage.py). Twenty failing at one instant used to
    drive one shared delay to its cap, so each waited out half the cap or more after
    the database was back (and the first were already redelivered during the outage)."""
    parts = urlsplit(settings.database_url)
    proxy = await FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5432).start()
    try:
        via_proxy = proxy.route(settings.database_url)
        registry = recording_registry()
        jobs = [await dispatched_job(db_pool, "t.record", queue=queue) for _ in range(20)]
        async with running(
            settings, registry, queue, database_url=via_proxy, db_timeout=2.0
        ) as worker:
            consumer = worker.consumer
            assert consumer is not None
            # the cap out of reach: only the database answering can end a wait here
            consumer._db_retry_cap = 60.0
            proxy.refuse(True)
            proxy.cut()
            for job in jobs:
                await publish(channel, queue, job.message(1))
            await wait_for(lambda: consumer.requeued >= len(jobs), timeout=20)
            await asyncio.sleep(1.5)  # the outage goes on: nothing goes back meanwhile
            assert consumer.requeued == len(jobs)
            assert await queue_depth(channel, queue) == (0, 1)  # held by the worker, unacked
            assert awaiting_database() == len(jobs)
            rows = [await job_row(db_pool, job) for job in jobs]
            assert {r["status"] for r in rows} == {"dispatched"}
            proxy.refuse(False)

            async def all_succeeded() -> bool:
                rows = [await job_row(db_pool, job) for job in jobs]
                return {(r["status"], r["attempt"]) for r in rows} == {("succeeded", 1)}

            # a probe answers within 2 s of the database coming back (the shared delay
            # of before: 30-60 s here)
            await wait_for(all_succeeded, timeout=20, message="every held delivery ran")
            assert awaiting_database() == 0
        for job in jobs:
            assert await effects(db_pool, job, effects_table) == 1
        assert await queue_depth(channel, queue) == (0, 0)
    finally:
        await proxy.stop()


@pytest.mark.parametrize("ending", ["failure", "snooze"])
async def test_a_failure_the_outage_kept_from_recording_is_a_warning_then_runs_again(
    ending: str,
    caplog: pytest.LogCaptureFixture,
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    """A handler fails while the database is cut, so its failure cannot be recorded:
    one warning without a traceback (every delivery of an outage used to log an ERROR
    with one, thousands in a chaos run, burying ``database_unreachable``). The delivery
    goes back when the database answers and runs again as the same attempt. The same
    for a snooze that could not be recorded."""
    parts = urlsplit(settings.database_url)
    proxy = await FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5432).start()
    try:
        registry = Registry()
        started = asyncio.Event()
        release = asyncio.Event()
        runs: list[int] = []

        @registry.task("t.fails_in_outage")
        async def fails_in_outage(ctx: JobContext, payload: dict[str, Any]) -> None:
            runs.append(ctx.attempt)
            if len(runs) == 1:
                started.set()
                await release.wait()
                if ending == "snooze":
                    raise Snooze(0.1)
                raise RuntimeError("the handler's own failure")

        job = await dispatched_job(db_pool, "t.fails_in_outage", queue=queue)
        async with running(
            settings,
            registry,
            queue,
            database_url=proxy.route(settings.database_url),
            db_timeout=2.0,
        ):
            await publish(channel, queue, job.message(1))
            await asyncio.wait_for(started.wait(), 10)
            proxy.refuse(True)
            proxy.cut()
            release.set()

            def logged(event: str) -> list[dict[str, Any]]:
                return [
                    {**r.msg, "levelno": r.levelno}
                    for r in caplog.records
                    if isinstance(r.msg, dict) and r.msg.get("event") == event
                ]

            event = f"{ending}_not_recorded"
            await wait_for(lambda: logged(event), timeout=10)
            (line,) = logged(event)
            assert line["levelno"] == logging.WARNING
            assert "exc_info" not in line and "exception" not in line
            if ending == "failure":
                assert line["error"] == "RuntimeError: the handler's own failure"
                assert line["cause"]  # why it could not be recorded
            else:
                assert line["error"]  # why the snooze could not be recorded
            proxy.refuse(False)

            async def succeeded() -> bool:
                row = await job_row(db_pool, job)
                return (row["status"], row["attempt"]) == ("succeeded", 1)

            await wait_for(succeeded, timeout=20, message="the held delivery ran again")
        assert runs == [1, 1]
    finally:
        await proxy.stop()


async def test_broker_connection_cut_mid_handler_effect_once(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """The worker's AMQP connection drops while a handler runs: the broker requeues the
    message, the handler still commits, its ack is lost; the redelivery after the
    reconnect finds the job done and is acked. The effect lands once."""
    parts = urlsplit(settings.amqp_url)
    proxy = await FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5672).start()
    try:
        via_proxy = proxy.route(settings.amqp_url)
        registry = Registry()
        started = asyncio.Event()
        release = asyncio.Event()
        calls = 0

        @registry.task("t.held")
        async def held(ctx: JobContext, payload: dict[str, Any]) -> None:
            nonlocal calls
            calls += 1
            await ctx.db.execute(
                f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt) VALUES ($1, $2)",
                ctx.job_id,
                ctx.attempt,
            )
            started.set()
            await release.wait()

        job = await dispatched_job(db_pool, "t.held", queue=queue)
        async with running(settings, registry, queue, amqp_url=via_proxy) as worker:
            consumer = worker.consumer
            assert consumer is not None
            await publish(channel, queue, job.message(1))
            await asyncio.wait_for(started.wait(), 10)
            assert proxy.cut() >= 1
            release.set()
            await wait_for(lambda: status_is(db_pool, job, "succeeded", 1), timeout=10)

            async def redelivered_and_settled() -> bool:
                ready, consumers = await queue_depth(channel, queue)
                return consumers == 1 and ready == 0 and consumer.in_flight == 0

            await wait_for(redelivered_and_settled, timeout=30)
        assert calls == 1  # the redelivery never reached the handler
        assert await effects(db_pool, job, effects_table) == 1
        assert await queue_depth(channel, queue) == (0, 0)
    finally:
        await proxy.stop()
