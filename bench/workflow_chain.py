"""Workflows: how soon a chain's next step starts after the previous step's outcome
committed, end to end (release trigger -> NOTIFY -> dispatcher claim -> RabbitMQ ->
worker -> handler); docs/benchmarks.md, "Workflows".

Usage::

    .venv/bin/python -m bench.workflow_chain [--dsn postgresql://postgres@127.0.0.1:5432/postgres]
        [--amqp amqp://guest:guest@127.0.0.1:5672/] [--chains 50]

In a scratch database: an in-process dispatcher (one fenced term) and worker, as the
integration tests run them. ``--chains`` 3-step chains run one after another on the
otherwise idle system; for steps 2 and 3 the gap is the handler's start (wall clock of
this host) minus the previous step's ``finished_at`` (the database clock of the same
host: the commit of its outcome, within the statement). Printed: p50/p90/p99/max (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
import uuid
from typing import Any

import aio_pika

from bench.harness import scratch_database
from scheduler import db
from scheduler.broker import job_queue_names
from scheduler.config import load_settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher, DispatcherConfig
from scheduler.duties.knobs import config_from_settings
from scheduler.store.fence import FenceStore
from scheduler.store.jobs import JobStore
from scheduler.workflow import chain, step
from workers import JobContext, Registry, Worker


async def run(dsn: str, amqp: str, chains: int) -> dict[str, Any]:
    queue = f"bench-wf-{uuid.uuid4().hex[:6]}"
    started: dict[int, float] = {}
    async with scratch_database(dsn) as (url, head):
        settings = load_settings(
            env={},
            overrides={"database_url": url, "amqp_url": amqp, "node_id": "bench-wf"},
        )
        pool = await db.create_pool(url, max_size=6)
        registry = Registry()

        @registry.task("bench.step")
        async def handler(ctx: JobContext, payload: dict[str, Any]) -> int:
            started[ctx.job_id] = time.time()
            return len(ctx.dependencies)

        try:
            assert await FenceStore(pool).advance(1, "bench-wf")
            await pool.execute("INSERT INTO duetime.queues (name) VALUES ($1)", queue)
            config = config_from_settings(DispatcherConfig, settings)
            dispatcher = Dispatcher(DutyContext.standalone(settings, pool), config=config)
            dispatcher.loop.start(LeaderTerm(epoch=1, node_id="bench-wf"))
            worker = Worker(settings, queues=[queue], registry=registry, concurrency=4)
            await worker.start()
            store = JobStore(pool)
            gaps: list[float] = []
            try:
                for _ in range(chains):
                    wf = chain(*(step("bench.step", queue=queue) for _ in range(3)))
                    ids = (await store.enqueue_workflow(wf)).ids
                    await store.result(ids[-1], timeout=30)
                    rows = await pool.fetch(
                        "SELECT id, finished_at FROM duetime.jobs WHERE id = ANY($1) ORDER BY id",
                        ids,
                    )
                    for prev, nxt in itertools.pairwise(rows):
                        gaps.append((started[nxt["id"]] - prev["finished_at"].timestamp()) * 1000)
            finally:
                await worker.stop()
                await dispatcher.loop.stop()
                await asyncio.sleep(0.2)
                async with await aio_pika.connect(amqp) as conn:
                    ch = await conn.channel()
                    for name in job_queue_names(queue):
                        await ch.queue_delete(name)
        finally:
            await pool.close()
    q = statistics.quantiles(gaps, n=100, method="inclusive")
    return {
        **head,
        "chains": chains,
        "gaps": len(gaps),
        "step_start_after_previous_commit_ms": {
            "p50": round(q[49], 1),
            "p90": round(q[89], 1),
            "p99": round(q[98], 1),
            "max": round(max(gaps), 1),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--chains", type=int, default=50)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.dsn, args.amqp, args.chains)), indent=2))


if __name__ == "__main__":
    main()
