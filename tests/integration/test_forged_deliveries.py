"""Forged and stale deliveries against a real worker (real PostgreSQL, real RabbitMQ).

Anyone who can publish to a job queue can copy a real job's message (docs/security.md):
copies of the attempt that is running are dropped without running, in its worker process
and in any other (the attempt's guard lock), a message of
another dispatch than the row's (``dispatch_epoch``) is dropped as stale, and messages
naming a shard no worker knows are dead-lettered without holding the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel
from prometheus_client import REGISTRY

from scheduler.config import Settings
from scheduler.config.shards import DEFAULT_SHARD
from tests.fixtures_tasks.basic import EFFECTS_TABLE
from tests.fixtures_tasks.jobs import dispatched_job, effects, job_row, publish, queue_depth
from tests.integration.test_worker_process import consumers_are, worker_argv, worker_env
from tests.support.procs import Processes
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker

pytestmark = pytest.mark.timeout(90)

#: How long the slow handler runs: long enough for every copy to arrive meanwhile.
HANDLER_SECONDS = 1.0


@dataclasses.dataclass
class Runs:
    """Per job id: handler runs, runs at once now, most runs at once."""

    total: dict[int, int] = dataclasses.field(default_factory=dict)
    now: dict[int, int] = dataclasses.field(default_factory=dict)
    peak: dict[int, int] = dataclasses.field(default_factory=dict)


def registry(runs: Runs) -> Registry:
    reg = Registry()

    @reg.task("t.forged.slow")
    async def slow(ctx: JobContext, payload: dict[str, Any]) -> None:
        job = ctx.job_id
        runs.total[job] = runs.total.get(job, 0) + 1
        runs.now[job] = runs.now.get(job, 0) + 1
        runs.peak[job] = max(runs.peak.get(job, 0), runs.now[job])
        try:
            await asyncio.sleep(payload.get("sleep", HANDLER_SECONDS))
        finally:
            runs.now[job] -= 1

    return reg


@contextlib.asynccontextmanager
async def running(settings: Settings, queue: str, runs: Runs, **kw: Any) -> AsyncIterator[Worker]:
    worker = Worker(settings, queues=[queue], registry=registry(runs), grace_period=5, **kw)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def status(pool: asyncpg.Pool, job: Any) -> str:
    return str((await job_row(pool, job))["status"])


def dropped(shard: str, reason: str) -> float:
    labels = {"shard": shard, "reason": reason}
    return REGISTRY.get_sample_value("duetime_deliveries_dropped_total", labels) or 0.0


async def test_copies_of_a_running_jobs_message_never_run_it_twice_at_once(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    runs = Runs()
    job = await dispatched_job(db_pool, "t.forged.slow", queue=queue)
    other = await dispatched_job(db_pool, "t.forged.slow", {"sleep": 0}, queue=queue)
    message = job.message(1)
    async with running(settings, queue, runs, concurrency=8):
        await publish(channel, queue, message)  # the real one
        for _ in range(200):  # forged copies, byte for byte
            await publish(channel, queue, message)
        started = time.monotonic()
        await publish(channel, queue, other.message(1))
        await wait_for(
            lambda: _is(status(db_pool, other), "succeeded"), timeout=5, message="other job"
        )
        other_took = time.monotonic() - started
        await wait_for(lambda: _is(status(db_pool, job), "succeeded"), timeout=10)
        await wait_for(lambda: _is(queue_depth(channel, queue), (0, 1)), timeout=15)
    assert runs.peak[job.id] == 1, runs
    assert runs.total[job.id] == 1, runs
    assert other_took < 3.0, f"a real job waited {other_took:.1f}s behind forged copies"
    assert dropped(DEFAULT_SHARD, "running") >= 1


async def test_a_message_of_another_dispatch_is_dropped_as_stale(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    runs = Runs()
    job = await dispatched_job(db_pool, "t.forged.slow", {"sleep": 0}, queue=queue)
    before = dropped(DEFAULT_SHARD, "stale_epoch")
    forged = dataclasses.replace(job.message(1), epoch=job.epoch + 1)
    async with running(settings, queue, runs, concurrency=2):
        await publish(channel, queue, forged)
        await wait_for(lambda: _is(queue_depth(channel, queue), (0, 1)), timeout=10)
        await wait_for(lambda: _true(dropped(DEFAULT_SHARD, "stale_epoch") > before), timeout=5)
        assert await status(db_pool, job) == "dispatched"  # the row's own message runs it
        assert runs.total.get(job.id, 0) == 0
        await publish(channel, queue, job.message(1))
        await wait_for(lambda: _is(status(db_pool, job), "succeeded"), timeout=10)
    assert runs.total[job.id] == 1


async def test_messages_for_an_unknown_shard_do_not_hold_the_queue(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    runs = Runs()
    ghost = await dispatched_job(db_pool, "t.forged.slow", {"sleep": 0}, queue=queue)
    job = await dispatched_job(db_pool, "t.forged.slow", {"sleep": 0}, queue=queue)
    before = dropped("nowhere", "unknown_shard")
    async with running(settings, queue, runs, concurrency=2):
        for _ in range(40):
            await publish(channel, queue, dataclasses.replace(ghost.message(1), shard="nowhere"))
        started = time.monotonic()
        await publish(channel, queue, job.message(1))
        await wait_for(lambda: _is(status(db_pool, job), "succeeded"), timeout=10)
        took = time.monotonic() - started
        # every one dead-lettered, none left holding the queue
        await wait_for(lambda: _is(queue_depth(channel, queue), (0, 1)), timeout=10)
    assert took < 3.0, f"a real job waited {took:.1f}s behind unknown-shard messages"
    assert dropped("nowhere", "unknown_shard") - before == 40
    assert await status(db_pool, ghost) == "dispatched"  # never failed for it


async def _is(value: Any, want: Any) -> bool:
    return await value == want


async def _true(value: bool) -> bool:
    return value


#: Byte-identical copies of the current message, published at once to two processes.
PROCESS_COPIES = 8


async def test_copies_in_two_worker_processes_run_once_and_a_kill9_lets_the_copy_run(
    procs: Processes,
    test_env: dict[str, str],
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
    tmp_path: Path,
) -> None:
    """Two ``duetime worker`` processes each get copies of the current message at the
    same instant: one runs the handler, the other acks its copies without a run (the
    attempt's guard lock, migration 0012). Killed with -9 mid-handler, the runner's
    session ends, its guard with it, and the redelivered copy runs in the other process:
    nothing lost, the effect once."""
    hold = tmp_path / "hold"
    hold.touch()
    starts = tmp_path / "starts"
    payload = {"hold_while_exists": str(hold), "starts_file": str(starts)}
    job = await dispatched_job(db_pool, "fixtures.record", payload, queue=queue)
    argv = worker_argv(queue, concurrency=PROCESS_COPIES, grace=5)
    workers = [
        procs.spawn(argv, name=f"worker-{n}", env=worker_env(test_env, f"{n}-{unique}"))
        for n in ("a", "b")
    ]
    await wait_for(lambda: consumers_are(channel, queue, 2), timeout=30, message=workers[0].tail())
    body = job.message(1).encode()
    await asyncio.gather(*(publish(channel, queue, body) for _ in range(PROCESS_COPIES)))

    def runs() -> list[int]:
        return [int(line) for line in starts.read_text().split()] if starts.exists() else []

    await wait_for(lambda: _true(len(runs()) >= 1), timeout=15, message=workers[1].tail())
    runner = next(w for w in workers if w.pid == runs()[0])
    other = next(w for w in workers if w is not runner)
    await wait_for(lambda: _is(queue_depth(channel, queue), (0, 2)), timeout=15)
    await asyncio.sleep(1.0)  # any second run would have started by now
    assert runs() == [runner.pid], runs()
    # the other process got copies too, and dropped them as running elsewhere
    assert '"where": "another worker"' in other.output(), other.tail()
    assert await status(db_pool, job) == "dispatched"

    runner.kill9()
    hold.unlink()  # whoever runs the job now may finish
    await wait_for(lambda: _is(status(db_pool, job), "succeeded"), timeout=30, message=other.tail())
    assert runs() == [runner.pid, other.pid]
    assert await effects(db_pool, job, EFFECTS_TABLE) == 1  # the killed run rolled back
    assert await other.stop(timeout=15) == 0
