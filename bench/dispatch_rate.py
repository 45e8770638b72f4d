"""Dispatch throughput, and the raw limits it is made of, measured in the same run.

Usage::

    .venv/bin/python bench/dispatch_rate.py [--dsn postgresql://postgres@127.0.0.1:5432/postgres]
        [--amqp amqp://guest:guest@127.0.0.1:5672/] [--jobs 100000] [--batch-sizes 100,500,1000]

``--dsn`` names a server; the script creates a scratch database of its own, migrates it,
measures, drops it, and prints one JSON document. On ``--amqp`` it uses one scratch
queue, purged between phases and deleted at the end. For each batch size:

- ``dispatch``: ``Dispatcher.dispatch_batch`` until ``--jobs`` due jobs are done — each
  claimed (fenced), published with confirms, marked dispatched and committed; jobs/s,
  and the mean time per batch spent claiming, publishing, marking and committing (the
  last tells whether pipelining the commit could pay);
- ``claim_only``: the same fenced transaction, the same claim and mark statements,
  committed, without publishing: rows/s (the database's ceiling);
- ``publish_only``: ``Publisher.publish`` of the same number of messages in batches of
  the same size on a channel with the same settings: confirmed msgs/s (the broker's);

and the ratios of ``dispatch`` to each limit. ``idle_lag`` places 200 jobs due at
scattered times over ~3 s ahead of an idle dispatcher loop and reports
``dispatched_at − due_at`` (database clock) p50/p90/p99/max.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import asyncpg

from scheduler import broker, db
from scheduler.config import load_settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher, DispatcherConfig
from scheduler.duties.knobs import config_from_settings
from scheduler.log import configure_logging
from scheduler.migrate import migrate
from scheduler.publisher import Publisher
from scheduler.store.dispatch import DispatchStore
from scheduler.store.fence import FenceStore
from scheduler.store.fenced import fenced_transaction
from scheduler.store.queues import QueueStore
from scheduler.store.rows import ClaimedJob

T = TypeVar("T")
EPOCH = 1
INSERT_DUE = (
    "INSERT INTO duetime.jobs (task, payload, due_at, queue) "
    "SELECT 'bench.task', jsonb_build_object('i', i, 'to', 'someone@example.com'), "
    "       now() - random() * interval '10 minutes', $1 "
    "  FROM generate_series(1, $2) AS i"
)


def _with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


class Timed:
    """Accumulates the time spent in wrapped coroutines, per name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        async def timed(*args: Any, **kwargs: Any) -> T:
            started = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

        return timed


async def reset_jobs(pool: asyncpg.Pool, queue: str, n: int) -> None:
    await pool.execute("TRUNCATE duetime.jobs")
    await pool.execute(INSERT_DUE, queue, n)
    await pool.execute("VACUUM ANALYZE duetime.jobs")


async def purge(url: str, queue: str) -> None:
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        q = await broker.declare_job_queue(channel, queue, delivery_limit=20)
        await q.purge(timeout=60)


async def bench_dispatch(
    settings: Any, pool: asyncpg.Pool, queue: str, n: int, batch: int
) -> dict[str, Any]:
    await reset_jobs(pool, queue, n)
    # a raw limit: the broker's buffer is not bounded here (twice every job: a queue is
    # refilled only once a quarter of its buffer is free, scheduler.duties.credit)
    config = config_from_settings(
        DispatcherConfig, settings, batch_size=batch, publish_timeout=10.0, buffer=max(1, 2 * n)
    )
    dispatcher = Dispatcher(DutyContext.standalone(settings, pool), config=config)
    await dispatcher.setup()
    dispatcher.loop.bind(LeaderTerm(EPOCH, "bench"))
    await dispatcher.read_limits()  # what run_once does first (the bench's ``--limit``)
    timed = Timed()
    store = dispatcher.store
    store.claim = timed.wrap("claim", store.claim)  # type: ignore[method-assign,assignment]
    store.mark_dispatched = timed.wrap("mark", store.mark_dispatched)  # type: ignore[method-assign,assignment]
    dispatcher.publisher.publish = timed.wrap(  # type: ignore[method-assign,assignment]
        "publish", dispatcher.publisher.publish
    )
    await dispatcher.publisher.ensure_queue(queue)
    done = batches = failed = 0
    started = time.perf_counter()
    try:
        while done < n:
            report = await dispatcher.dispatch_batch()
            if report.claimed == 0:
                break
            done += report.published
            failed += report.failed
            batches += 1
    finally:
        elapsed = time.perf_counter() - started
        await dispatcher.teardown()
    dispatched = await pool.fetchval(
        "SELECT count(*) FROM duetime.jobs WHERE status = 'dispatched'"
    )
    accounted = sum(timed.seconds.values())
    per_batch = {k: round(v / batches * 1000, 2) for k, v in timed.seconds.items()}
    per_batch["begin_fence_commit_other"] = round((elapsed - accounted) / batches * 1000, 2)
    return {
        "jobs_per_s": round(done / elapsed),
        "seconds": round(elapsed, 2),
        "dispatched": dispatched,
        "publish_failures": failed,
        "batches": batches,
        "ms_per_batch": per_batch,
    }


async def bench_claim_only(pool: asyncpg.Pool, queue: str, n: int, batch: int) -> dict[str, Any]:
    await reset_jobs(pool, queue, n)
    store = DispatchStore(pool)
    done = 0
    started = time.perf_counter()
    while done < n:
        async with pool.acquire() as conn, fenced_transaction(conn, EPOCH):
            jobs = await store.claim(conn, batch)
            if not jobs:
                break
            done += len(await store.mark_dispatched(conn, jobs, EPOCH))
    elapsed = time.perf_counter() - started
    return {"rows_per_s": round(done / elapsed), "seconds": round(elapsed, 2), "rows": done}


async def bench_publish_only(settings: Any, queue: str, n: int, batch: int) -> dict[str, Any]:
    publisher = Publisher.from_settings(settings, name="bench", publish_timeout=10.0)
    await publisher.open()
    try:
        await publisher.ensure_queue(queue)
        now = datetime.now(UTC)
        jobs = [
            ClaimedJob(
                id=i + 1,
                task="bench.task",
                queue=queue,
                due_at=now,
                attempt=1,
            )
            for i in range(n)
        ]
        confirmed = 0
        started = time.perf_counter()
        for i in range(0, n, batch):
            result = await publisher.publish(jobs[i : i + batch], EPOCH)
            confirmed += len(result.confirmed)
        elapsed = time.perf_counter() - started
    finally:
        await publisher.close()
    return {
        "msgs_per_s": round(confirmed / elapsed),
        "seconds": round(elapsed, 2),
        "confirmed": confirmed,
    }


async def bench_idle_lag(settings: Any, pool: asyncpg.Pool, queue: str) -> dict[str, Any]:
    await pool.execute("TRUNCATE duetime.jobs")
    await pool.execute(
        "INSERT INTO duetime.jobs (task, due_at, queue) "
        "SELECT 'bench.task', now() + interval '1 second' + random() * interval '3 second', $1"
        "  FROM generate_series(1, 200)",
        queue,
    )
    dispatcher = Dispatcher(DutyContext.standalone(settings, pool))
    dispatcher.loop.start(LeaderTerm(EPOCH, "bench"))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE status = 'pending'")
            if left == 0:
                break
            await asyncio.sleep(0.2)
    finally:
        await dispatcher.loop.stop()
    lags = sorted(
        r["lag"] * 1000
        for r in await pool.fetch(
            "SELECT extract(epoch FROM dispatched_at - due_at)::float8 AS lag "
            "FROM duetime.jobs WHERE status = 'dispatched'"
        )
    )
    q = statistics.quantiles(lags, n=100)
    return {
        "jobs": len(lags),
        "p50_ms": round(q[49], 2),
        "p90_ms": round(q[89], 2),
        "p99_ms": round(q[98], 2),
        "max_ms": round(lags[-1], 2),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get(
            "DUETIME_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument(
        "--amqp",
        default=os.environ.get("DUETIME_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--batch-sizes", default="100,500,1000")
    parser.add_argument("--no-idle-lag", action="store_true")
    args = parser.parse_args()
    configure_logging("warning", "json")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    name = f"duetime_bench_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(args.dsn, timeout=10)
    await admin.execute(f'CREATE DATABASE "{name}"')
    dsn = _with_db(args.dsn, name)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {
        "benchmark": "dispatch_rate",
        "jobs": args.jobs,
        "queue": queue,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "runs": [],
    }
    try:
        await migrate(dsn)
        settings = load_settings(
            env={}, overrides={"database_url": dsn, "amqp_url": args.amqp, "node_id": "bench"}
        )
        pool = await db.create_pool(dsn, max_size=4)
        try:
            await QueueStore(pool).add(queue)  # only declared queues are claimed
            out["machine"]["postgresql"] = await pool.fetchval("SHOW server_version")
            out["machine"]["synchronous_commit"] = await pool.fetchval("SHOW synchronous_commit")
            await FenceStore(pool).advance(EPOCH, "bench")
            await purge(args.amqp, queue)
            for batch in batch_sizes:
                dispatch = await bench_dispatch(settings, pool, queue, args.jobs, batch)
                await purge(args.amqp, queue)
                claim = await bench_claim_only(pool, queue, args.jobs, batch)
                publish = await bench_publish_only(settings, queue, args.jobs, batch)
                await purge(args.amqp, queue)
                out["runs"].append(
                    {
                        "batch_size": batch,
                        "dispatch": dispatch,
                        "claim_only": claim,
                        "publish_only": publish,
                        "dispatch_vs_claim_only": round(
                            dispatch["jobs_per_s"] / claim["rows_per_s"], 3
                        ),
                        "dispatch_vs_publish_only": round(
                            dispatch["jobs_per_s"] / publish["msgs_per_s"], 3
                        ),
                    }
                )
                print(json.dumps(out["runs"][-1]), flush=True)
            if not args.no_idle_lag:
                out["idle_lag"] = await bench_idle_lag(settings, pool, queue)
        finally:
            await pool.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        connection = await aio_pika.connect(args.amqp, timeout=10)
        async with connection:
            channel = await connection.channel()
            for name in broker.job_queue_names(queue):
                await channel.queue_delete(name)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
