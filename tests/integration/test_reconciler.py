"""The reconciler (scheduler/duties/reconciler.py) against real PostgreSQL and RabbitMQ.

A crash that leaves rows ``dispatched`` without a message is simulated by writing such
rows directly (``dispatched_at`` long ago); a running job is simulated by another
connection holding the row ``FOR KEY SHARE``, as the worker's execution transaction does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import asyncpg
import pytest
from prometheus_client import REGISTRY

from scheduler import broker, db, messages
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.knobs import config_from_settings
from scheduler.duties.reconciler import Reconciler, ReconcilerConfig, ReconcileReport
from scheduler.errors import Fenced
from scheduler.store.fence import FenceStore
from tests.fixtures_tasks.jobs import FENCE_EPOCH, drain
from tests.support.helpers import declare_queues
from tests.support.wait import wait_for


@dataclass
class Env:
    settings: Settings
    pool: asyncpg.Pool
    fence: FenceStore
    queue: str


@pytest.fixture
async def env(migrated_dsn: str, settings: Settings, unique: str) -> AsyncIterator[Env]:
    pool = await db.create_pool(migrated_dsn, max_size=6)
    try:
        fence = FenceStore(pool)
        assert await fence.advance(1, "test-node")
        await declare_queues(pool, unique, f"{unique}-other")
        yield Env(dataclasses.replace(settings, database_url=migrated_dsn), pool, fence, unique)
    finally:
        await pool.close()


def make_reconciler(env: Env, **config: Any) -> Reconciler:
    cfg = config_from_settings(ReconcilerConfig, env.settings, visibility_timeout=60.0, **config)
    reconciler = Reconciler(DutyContext.standalone(env.settings, env.pool), config=cfg)
    reconciler.loop.bind(LeaderTerm(epoch=1, node_id="test-1"))
    return reconciler


async def insert_stalled(
    pool: asyncpg.Pool, queue: str, n: int, *, silent: float = 600.0
) -> list[int]:
    """Jobs a crashed dispatcher marked dispatched without a message reaching a queue
    (under the fence's epoch: the database refuses any other)."""
    rows = await pool.fetch(
        "INSERT INTO duetime.jobs (task, payload, due_at, queue, status, dispatched_at, "
        "                          dispatch_epoch) "
        "SELECT 'demo.task', jsonb_build_object('i', i), now() - interval '1 hour', $1, "
        f"       'dispatched', now() - make_interval(secs => $3), {FENCE_EPOCH} "
        "  FROM generate_series(1, $2) AS i RETURNING id",
        queue,
        n,
        silent,
    )
    return [r["id"] for r in rows]


def reconciled_total() -> float:
    return REGISTRY.get_sample_value("duetime_reconciled_total", {"shard": "main"}) or 0.0


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [r.msg for r in caplog.records if isinstance(r.msg, dict) and r.msg.get("event") == name]


async def test_stalled_jobs_are_republished_and_running_ones_left_alone(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    stalled = await insert_stalled(env.pool, env.queue, 5)
    [running] = await insert_stalled(env.pool, env.queue, 1)
    [beating] = await insert_stalled(env.pool, env.queue, 1)
    [fresh] = await insert_stalled(env.pool, env.queue, 1, silent=5.0)
    await env.pool.execute("UPDATE duetime.jobs SET heartbeat_at = now() WHERE id = $1", beating)

    worker = await db.connect(env.settings.database_url)  # a worker executing `running`
    reconciler = make_reconciler(env)
    await reconciler.setup()
    try:
        tx = worker.transaction()
        await tx.start()
        await worker.execute("SELECT 1 FROM duetime.jobs WHERE id = $1 FOR KEY SHARE", running)
        before = reconciled_total()
        with caplog.at_level(logging.WARNING):
            report = await reconciler.reconcile_batch()
        assert (report.stalled, report.republished, report.failed) == (5, 5, 0)
        assert reconciled_total() - before == 5
        [logged] = events(caplog, "jobs_reconciled")
        assert sorted(logged["job_ids"]) == stalled

        got = await drain(env.settings.amqp_url, env.queue, expect=5)
        bodies = sorted(
            ((messages.decode(m.body), m.message_id) for m in got), key=lambda b: b[0].job_id
        )
        assert [(b.job_id, mid) for b, mid in bodies] == [(i, f"{i}:1") for i in stalled]
        assert {b.epoch for b, _ in bodies} == {1}

        rows = {
            r["id"]: r
            for r in await env.pool.fetch(
                "SELECT id, dispatch_epoch, republish_count, heartbeat_at, "
                "       extract(epoch FROM now() - dispatched_at) AS age "
                "FROM duetime.jobs"
            )
        }
        for job_id in stalled:
            assert rows[job_id]["republish_count"] == 1 and rows[job_id]["age"] < 30
            assert rows[job_id]["dispatch_epoch"] == 1
        for job_id in (running, beating, fresh):
            assert rows[job_id]["republish_count"] == 0, job_id
        assert rows[beating]["heartbeat_at"] is not None

        # nothing left to do until the running job's worker goes away
        assert (await reconciler.reconcile_batch()).stalled == 0
        await tx.rollback()  # the worker died: its lock is gone
        report = await reconciler.reconcile_batch()
        assert (report.stalled, report.republished) == (1, 1)
        assert len(await drain(env.settings.amqp_url, env.queue, expect=1)) == 1
    finally:
        await worker.close()
        await reconciler.teardown()


async def test_backlogged_queue_is_deferred_until_it_drains(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A stalled job whose queue still holds ready messages is most likely one of them:
    re-publishing would only add a duplicate per timeout, so it waits for the drain."""
    other = f"{env.queue}-other"
    [waiting] = await insert_stalled(env.pool, env.queue, 1)
    [lost] = await insert_stalled(env.pool, other, 1)
    connection = await aio_pika.connect(env.settings.amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await broker.declare_job_queue(
            channel, env.queue, delivery_limit=env.settings.delivery_limit
        )
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"some": "backlog"}'), routing_key=queue.name
        )
        reconciler = make_reconciler(env, interval=0.3)
        await reconciler.setup()
        try:
            with caplog.at_level(logging.INFO):
                report = await reconciler.reconcile_batch()
            assert (report.stalled, report.republished, report.deferred) == (2, 1, 1)
            [deferred] = events(caplog, "reconcile_deferred")
            assert deferred["queue"] == env.queue and deferred["job_ids"] == [waiting]
            assert deferred["ready_messages"] == 1
            got = await drain(env.settings.amqp_url, other, expect=1)
            assert messages.decode(got[0].body).job_id == lost

            # within the deferral window the backlogged queue is not even locked
            assert (await reconciler.reconcile_batch()).stalled == 0
            await queue.purge()

            async def republished() -> bool:
                return (await reconciler.reconcile_batch()).republished == 1

            await wait_for(republished, timeout=5, message="deferred job re-published")
        finally:
            await reconciler.teardown()
    got = await drain(env.settings.amqp_url, env.queue, expect=1)
    assert messages.decode(got[0].body).job_id == waiting


async def test_repeated_rescue_is_counted_and_warned(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A job dead-lettered again and again (x-delivery-limit) stays dispatched and is
    rescued each visibility timeout; from ``warn_after`` rescues on it is called out."""
    [job_id] = await insert_stalled(env.pool, env.queue, 1)
    reconciler = make_reconciler(env, warn_after=2, defer_backlogged_queues=False)
    await reconciler.setup()
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                assert (await reconciler.reconcile_batch()).republished == 1
                await env.pool.execute(
                    "UPDATE duetime.jobs SET dispatched_at = now() - interval '10 minutes'"
                )
        repeated = events(caplog, "jobs_reconciled_repeatedly")
        assert [r["jobs"] for r in repeated] == [[(job_id, 2)], [(job_id, 3)]]
    finally:
        await reconciler.teardown()
    await drain(env.settings.amqp_url, env.queue, expect=3)


async def test_fenced_reconciler_changes_nothing(env: Env) -> None:
    await insert_stalled(env.pool, env.queue, 2)
    reconciler = make_reconciler(env)
    await reconciler.setup()
    try:
        assert await env.fence.advance(2, "newer")
        with pytest.raises(Fenced):
            await reconciler.reconcile_batch()
        assert (
            await env.pool.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE republish_count = 0 "
                "AND dispatched_at < now() - interval '5 minutes'"
            )
            == 2
        )
    finally:
        await reconciler.teardown()


async def test_reconciler_loop_rescues_jobs(env: Env) -> None:
    """Through start()/stop(): a job that goes silent while the loop runs is rescued
    once its visibility timeout (1 s here) has passed."""
    cfg = config_from_settings(ReconcilerConfig, env.settings, visibility_timeout=1.0, interval=0.2)
    reconciler = Reconciler(DutyContext.standalone(env.settings, env.pool), config=cfg)
    reconciler.loop.start(LeaderTerm(epoch=1, node_id="test-1"))
    try:
        started = time.monotonic()
        [job_id] = await insert_stalled(env.pool, env.queue, 1, silent=0.0)

        async def rescued() -> bool:
            return bool(
                await env.pool.fetchval(
                    "SELECT republish_count = 1 FROM duetime.jobs WHERE id = $1", job_id
                )
            )

        await wait_for(rescued, timeout=10, message="job rescued")
        assert time.monotonic() - started >= 1.0
    finally:
        await reconciler.loop.stop()
    assert reconciler.loop.stopped_by_request
    await drain(env.settings.amqp_url, env.queue, expect=1)


async def test_republishing_is_capped_and_the_count_survives_failover(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """A job whose message every worker dead-letters is re-published ``max_republishes``
    times, then goes dead saying why; each pass here is a new Reconciler (a new leader
    after a failover), so only the count in the row can stop it."""
    [job_id] = await insert_stalled(env.pool, env.queue, 1)
    [other] = await insert_stalled(env.pool, env.queue, 1)

    async def one_pass(epoch: int) -> ReconcileReport:
        assert await env.fence.advance(epoch, f"leader-{epoch}")
        cfg = config_from_settings(
            ReconcilerConfig, env.settings, max_republishes=2, defer_backlogged_queues=False
        )
        reconciler = Reconciler(DutyContext.standalone(env.settings, env.pool), config=cfg)
        reconciler.loop.bind(LeaderTerm(epoch=epoch, node_id=f"leader-{epoch}"))
        await reconciler.setup()
        try:
            return await reconciler.reconcile_batch()
        finally:
            await reconciler.teardown()
            await env.pool.execute(  # silent again: dead-lettered once more
                "UPDATE duetime.jobs SET dispatched_at = now() - interval '10 minutes' "
                "WHERE status = 'dispatched'"
            )

    assert (await one_pass(2)).republished == 2
    # `other` finished meanwhile and was dispatched again (a retry): its count restarts
    await env.pool.execute(
        "UPDATE duetime.jobs SET status = 'pending', dispatch_epoch = NULL WHERE id = $1", other
    )
    await env.pool.execute(
        f"UPDATE duetime.jobs SET status = 'dispatched', dispatch_epoch = {FENCE_EPOCH}, "
        "republish_count = 0, dispatched_at = now() - interval '10 minutes' WHERE id = $1",
        other,
    )
    assert (await one_pass(3)).republished == 2
    with caplog.at_level(logging.ERROR):
        report = await one_pass(4)
    assert (report.given_up, report.republished) == (1, 1)
    row = await env.pool.fetchrow(
        "SELECT status, republish_count, last_error, finished_at FROM duetime.jobs WHERE id = $1",
        job_id,
    )
    assert row["status"] == "dead" and row["finished_at"] is not None
    assert row["republish_count"] == 2
    assert row["last_error"].startswith("re-published 2 times (max_republishes)")
    assert "dead-letter queue" in row["last_error"]
    [logged] = events(caplog, "jobs_given_up")
    assert logged["job_ids"] == [job_id]
    assert (
        await env.pool.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", other)
        == "dispatched"
    )
    await drain(env.settings.amqp_url, env.queue, expect=5)


def test_max_republishes_is_validated() -> None:
    with pytest.raises(ValueError, match="max_republishes must be >= 1"):
        ReconcilerConfig(max_republishes=0)


def oldest_unstarted() -> float | None:
    return REGISTRY.get_sample_value("duetime_oldest_unstarted_seconds", {"shard": "main"})


async def test_oldest_unstarted_gauge(env: Env) -> None:
    """The leader's reconciler samples the age of the oldest dispatched job no worker
    started (``heartbeat_at`` unset); a job with a heartbeat does not count."""
    reconciler = make_reconciler(env)
    await reconciler.sample_unstarted()
    assert oldest_unstarted() == 0.0
    [beating] = await insert_stalled(env.pool, env.queue, 1, silent=900.0)
    await env.pool.execute("UPDATE duetime.jobs SET heartbeat_at = now() WHERE id = $1", beating)
    await insert_stalled(env.pool, env.queue, 3, silent=300.0)
    await reconciler.sample_unstarted()
    assert oldest_unstarted() == 0.0  # sampled at most every UNSTARTED_SAMPLE_INTERVAL
    reconciler._unstarted_sampled_at = None
    await reconciler.sample_unstarted()
    assert 300.0 <= (oldest_unstarted() or 0.0) < 360.0
