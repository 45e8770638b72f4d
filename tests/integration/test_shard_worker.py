"""A worker configured with several shards (real PostgreSQL databases, real RabbitMQ).

Two shard databases of this module's own; jobs are made ``dispatched`` by hand in each
(``tests.fixtures_tasks.jobs``) and published with their shard in the message. Fresh
databases number their jobs from 1, so both shards hold a job 1 with the same
``message_id`` and ledger key ``job:1``: only routing by shard tells them apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel
from prometheus_client import REGISTRY

from scheduler import db
from scheduler.config import Settings, load_settings
from tests.conftest import own_database
from tests.fixtures_tasks.basic import EFFECTS_DDL, EFFECTS_TABLE
from tests.fixtures_tasks.jobs import DispatchedJob, declare, dispatched_job, publish, queue_depth
from tests.support.helpers import delete_job_queue
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker
from workers.shards import pool_sizes

pytestmark = pytest.mark.timeout(90)

SHARDS = ("a", "b")


@pytest.fixture(scope="module")
async def shard_pools(server_dsn: str) -> AsyncIterator[dict[str, tuple[str, asyncpg.Pool]]]:
    """name -> (url, pool) of two migrated databases with the effects table."""
    async with contextlib.AsyncExitStack() as stack:
        found: dict[str, tuple[str, asyncpg.Pool]] = {}
        for name in SHARDS:
            url = await stack.enter_async_context(own_database(server_dsn, f"shard_{name}"))
            pool = await db.create_pool(url, max_size=4)
            stack.push_async_callback(pool.close)
            await pool.execute(EFFECTS_DDL)
            found[name] = (url, pool)
        yield found


def sharded_settings(base: Settings, urls: dict[str, str]) -> Settings:
    value = ",".join(f"{name}={url}" for name, url in urls.items())
    return load_settings(
        env={},
        overrides={
            "database_url": base.database_url,
            "amqp_url": base.amqp_url,
            "node_id": base.node_id,
            "log_format": "console",
            "shards": value,
        },
    )


@pytest.fixture
async def own_queue(channel: AbstractChannel, unique: str) -> AsyncIterator[str]:
    name = f"shards-{unique}"
    await declare(channel, name)
    yield name
    with contextlib.suppress(Exception):
        await delete_job_queue(channel, name)


def shard_registry() -> Registry:
    registry = Registry()

    @registry.task("t.shard")
    async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
        await ctx.db.execute(
            f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, $3)",
            ctx.job_id,
            ctx.attempt,
            # which database this connection is on: proves ctx.db is the job's shard
            await ctx.db.fetchval("SELECT current_database()"),
        )

    return registry


@contextlib.asynccontextmanager
async def running(settings: Settings, queue: str, **kw: Any) -> AsyncIterator[Worker]:
    worker = Worker(settings, queues=[queue], registry=shard_registry(), grace_period=5, **kw)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def succeeded(pool: asyncpg.Pool, job: DispatchedJob) -> bool:
    status = await pool.fetchval(
        "SELECT status FROM duetime.jobs WHERE id = $1 AND due_at = $2", job.id, job.due_at
    )
    return status == "succeeded"


async def effects_of(pool: asyncpg.Pool, job: DispatchedJob) -> list[str]:
    rows = await pool.fetch(f"SELECT tag FROM {EFFECTS_TABLE} WHERE job_id = $1", job.id)
    return [r["tag"] for r in rows]


async def ledger_of(pool: asyncpg.Pool, job: DispatchedJob) -> list[asyncpg.Record]:
    return await pool.fetch(
        "SELECT job_id, attempt FROM duetime.job_ledger WHERE idempotency_key = $1", job.key
    )


async def clear(pools: dict[str, tuple[str, asyncpg.Pool]]) -> None:
    for _, pool in pools.values():
        await pool.execute(
            f"TRUNCATE duetime.job_ledger, {EFFECTS_TABLE}; DELETE FROM duetime.jobs"
        )


def test_pool_budget_few_connections_at_idle_concurrency_under_load() -> None:
    one = pool_sizes(1, 16)
    assert (one.handler_min, one.handler_max, one.store_min, one.store_max) == (4, 20, 2, 8)
    assert pool_sizes(1, 2).handler_min == 2
    assert (one.handler_init, one.store_init) == (16, 4)  # open full: no cold start
    three = pool_sizes(3, 8)
    assert (three.handler_min, three.handler_max, three.store_min, three.store_max) == (1, 10, 2, 8)
    assert 3 * (three.handler_max + three.store_max) < 100  # max_connections default


async def test_jobs_of_both_shards_run_in_their_own_database_once_each(
    settings: Settings,
    shard_pools: dict[str, tuple[str, asyncpg.Pool]],
    channel: AbstractChannel,
    own_queue: str,
) -> None:
    await clear(shard_pools)
    urls = {name: url for name, (url, _) in shard_pools.items()}
    pools = {name: pool for name, (_, pool) in shard_pools.items()}
    jobs = {n: await dispatched_job(pools[n], "t.shard", queue=own_queue) for n in SHARDS}
    extra = await dispatched_job(pools["b"], "t.shard", queue=own_queue)
    async with running(sharded_settings(settings, urls), own_queue, concurrency=4) as worker:
        assert list(worker.shards) == ["a", "b"]
        for name, job in jobs.items():
            message = dataclasses.replace(job.message(1), shard=name)
            await publish(channel, own_queue, message)
            await publish(channel, own_queue, message)  # a duplicate delivery
        await publish(channel, own_queue, dataclasses.replace(extra.message(1), shard="b"))
        for name, job in jobs.items():
            await wait_for(lambda p=pools[name], j=job: succeeded(p, j), timeout=15)
        await wait_for(lambda: succeeded(pools["b"], extra), timeout=15)

        async def settled() -> bool:
            assert worker.consumer is not None
            idle = worker.consumer.in_flight == 0
            return idle and await queue_depth(channel, own_queue) == (0, 1)

        await wait_for(settled, timeout=15)
        # one shard's pools stay small: one handler connection kept, two store ones
        assert worker.shards["a"].pool.get_min_size() == 1
        assert worker.shards["a"].store_pool.get_max_size() == 8
    assert jobs["a"].id == jobs["b"].id  # same id, same message_id: told apart by shard
    db_names = {n: urls[n].rsplit("/", 1)[1] for n in SHARDS}
    for name, job in jobs.items():
        # effect once (the duplicate found the ledger row), in the job's own database
        assert await effects_of(pools[name], job) == [db_names[name]]
        ledger = await ledger_of(pools[name], job)
        assert [(r["job_id"], r["attempt"]) for r in ledger] == [(job.id, 1)]
    assert await effects_of(pools["b"], extra) == [db_names["b"]]
    assert await effects_of(pools["a"], extra) == []  # nothing of shard b's job 2 in a
    assert await pools["a"].fetchval("SELECT count(*) FROM duetime.job_ledger") == 1


def executed(shard: str) -> tuple[float, float, float]:
    """This process's succeeded ``t.shard`` executions of ``shard``: finished, handler
    durations observed, fire lags observed."""
    sample = REGISTRY.get_sample_value
    labels = {"shard": shard, "task": "t.shard"}
    return (
        sample("duetime_jobs_finished_total", {**labels, "outcome": "succeeded"}) or 0.0,
        sample("duetime_job_duration_seconds_count", labels) or 0.0,
        sample("duetime_fire_lag_seconds_count", {"shard": shard}) or 0.0,
    )


async def test_a_two_shard_worker_counts_executions_per_shard(
    settings: Settings,
    shard_pools: dict[str, tuple[str, asyncpg.Pool]],
    channel: AbstractChannel,
    own_queue: str,
) -> None:
    await clear(shard_pools)
    urls = {name: url for name, (url, _) in shard_pools.items()}
    pools = {name: pool for name, (_, pool) in shard_pools.items()}
    per_shard = {"a": 1, "b": 2}
    jobs = {
        name: [await dispatched_job(pools[name], "t.shard", queue=own_queue) for _ in range(n)]
        for name, n in per_shard.items()
    }
    before = {name: executed(name) for name in (*SHARDS, "main")}
    async with running(sharded_settings(settings, urls), own_queue, concurrency=4):
        for name, shard_jobs in jobs.items():
            for job in shard_jobs:
                await publish(channel, own_queue, dataclasses.replace(job.message(1), shard=name))
        for name, shard_jobs in jobs.items():
            for job in shard_jobs:
                await wait_for(lambda p=pools[name], j=job: succeeded(p, j), timeout=15)
    for name, n in per_shard.items():
        counted = [after - was for after, was in zip(executed(name), before[name], strict=True)]
        assert counted == [n, n, n], name
        # a 0 sample per shard from the start: the first mismatch is an increase
        assert REGISTRY.get_sample_value("duetime_message_row_mismatch_total", {"shard": name}) == 0
    assert executed("main") == before["main"]  # nothing of a sharded worker's is "main"


async def test_a_delivery_for_an_unknown_shard_is_dead_lettered_not_failed(
    settings: Settings,
    shard_pools: dict[str, tuple[str, asyncpg.Pool]],
    channel: AbstractChannel,
    own_queue: str,
) -> None:
    await clear(shard_pools)
    urls = {name: url for name, (url, _) in shard_pools.items()}
    pool_b = shard_pools["b"][1]
    job = await dispatched_job(pool_b, "t.shard", queue=own_queue)
    message = dataclasses.replace(job.message(1), shard="b")
    only_a = sharded_settings(settings, {"a": urls["a"]})
    async with running(only_a, own_queue, concurrency=2) as worker:
        assert worker.consumer is not None
        consumer = worker.consumer
        await publish(channel, own_queue, message)
        # requeued at once for another worker, a bounded number of times, then
        # dead-lettered: the queue is empty again, the job untouched
        await wait_for(lambda: consumer.requeued >= 2, timeout=15, message="requeued twice")
        await wait_for(lambda: _depth_is(channel, own_queue, (0, 1)), timeout=10)
        assert (await pool_b.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job.id)) == (
            "dispatched"
        )
    assert await effects_of(pool_b, job) == []
    # the row is still dispatched: shard b's reconciler publishes it again, and a worker
    # that knows shard b takes it
    async with running(sharded_settings(settings, urls), own_queue, concurrency=2):
        await publish(channel, own_queue, message)
        await wait_for(lambda: succeeded(pool_b, job), timeout=15)
    assert await effects_of(pool_b, job) == [urls["b"].rsplit("/", 1)[1]]


async def _depth_is(channel: AbstractChannel, queue: str, want: tuple[int, int]) -> bool:
    return await queue_depth(channel, queue) == want
