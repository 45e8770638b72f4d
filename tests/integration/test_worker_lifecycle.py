"""Worker startup/shutdown hooks and ``ctx.state`` (``workers.lifecycle``), against real
PostgreSQL and RabbitMQ: hooks run once, before the first delivery and after the last
job; a failing startup hook stops the worker before it consumes anything, with one line
and exit 1 from the real command."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from scheduler.config import Settings
from tests.fixtures_tasks.jobs import dispatched_job, job_row, publish, queue_depth
from tests.support.procs import Processes, duetime_argv
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker
from workers.lifecycle import WorkerStartupFailed, WorkerState

pytestmark = pytest.mark.timeout(60)


async def test_hooks_open_what_handlers_share_once_and_close_it_after_the_last_job(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    registry = Registry()
    events: list[str] = []

    class Client:
        def __init__(self) -> None:
            self.calls = 0
            self.closed = False

    @registry.on_startup
    async def open_client(state: WorkerState) -> None:
        events.append("startup")
        state.client = Client()

    @registry.on_startup
    def plain_def_hook(state: WorkerState) -> None:  # runs in a thread
        events.append("startup-sync")
        state.ready = True

    @registry.on_shutdown
    async def close_client(state: WorkerState) -> None:
        events.append(f"shutdown after {state.client.calls} calls")
        state.client.closed = True

    @registry.task("t.use_client")
    async def use_client(ctx: JobContext, payload: dict[str, Any]) -> None:
        assert ctx.state.ready and not ctx.state.client.closed
        ctx.state.client.calls += 1
        events.append("job")

    jobs = [await dispatched_job(db_pool, "t.use_client", {}, queue=queue) for _ in range(3)]
    worker = Worker(dataclasses.replace(settings), queues=[queue], registry=registry, concurrency=2)
    await worker.start()
    try:
        assert events == ["startup", "startup-sync"]  # before anything is consumed
        for job in jobs:
            await publish(channel, queue, job.message(1))

        async def all_done() -> bool:
            rows = [await job_row(db_pool, j) for j in jobs]
            return all(r["status"] == "succeeded" for r in rows)

        await wait_for(all_done, timeout=15)
    finally:
        await worker.stop()
    assert events == ["startup", "startup-sync", "job", "job", "job", "shutdown after 3 calls"]
    assert registry.lifecycle.state.client.closed


async def test_a_failing_startup_hook_stops_the_worker_before_it_consumes(
    settings: Settings, db_pool: asyncpg.Pool, channel: AbstractChannel, queue: str
) -> None:
    registry = Registry()
    closed: list[str] = []

    @registry.on_startup
    async def first(state: WorkerState) -> None:
        state.opened = True

    @registry.on_startup
    async def broken(state: WorkerState) -> None:
        raise ConnectionRefusedError("payments API down")

    @registry.on_shutdown
    async def close_first(state: WorkerState) -> None:
        closed.append("first")

    @registry.task("t.never")
    async def never(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise AssertionError("must not run")

    job = await dispatched_job(db_pool, "t.never", {}, queue=queue)
    await publish(channel, queue, job.message(1))
    worker = Worker(settings, queues=[queue], registry=registry, concurrency=2)
    with pytest.raises(WorkerStartupFailed) as failed:
        await worker.start()
    assert "broken failed: ConnectionRefusedError: payments API down" in str(failed.value)
    assert closed == ["first"]  # what the earlier hook opened is closed
    assert await queue_depth(channel, queue) == (1, 0)  # the message is still queued
    assert (await job_row(db_pool, job))["status"] == "dispatched"
    await worker.stop()


def test_hooks_must_take_the_state() -> None:
    registry = Registry()
    from scheduler.errors import InvalidInput

    with pytest.raises(InvalidInput, match="must take one argument"):
        registry.on_startup(lambda: None)


async def test_the_command_exits_1_with_one_line_when_a_startup_hook_fails(
    test_env: dict[str, str], procs: Processes, tmp_path: Path, unique: str
) -> None:
    module = tmp_path / f"hooks_{unique}.py"
    module.write_text(
        "from duetime import task, worker_startup\n\n"
        "@worker_startup\n"
        "async def connect_payments(state):\n"
        "    raise RuntimeError('payments API unreachable')\n\n"
        "@task('noop')\n"
        "async def noop(ctx, payload):\n"
        "    pass\n"
    )
    env = {**test_env, "PYTHONPATH": f"{tmp_path}:{Path.cwd()}"}
    argv = duetime_argv("worker", "--import", module.stem, "--queue", f"q_{unique}")
    child = procs.spawn(argv, env=env, cwd=tmp_path)
    code = await child.wait(timeout=30)
    assert code == 1, child.tail()
    errors = [line for line in child.output().splitlines() if line.startswith("duetime: error:")]
    assert errors == [
        f"duetime: error: worker startup hook {module.stem}.connect_payments failed: "
        "RuntimeError: payments API unreachable"
    ], child.tail()
    assert sys.executable  # the child ran with this interpreter (duetime_argv)


async def test_plain_def_handlers_read_the_state_too() -> None:
    from duetime.testing import run_task

    registry = Registry()

    @registry.on_startup
    def open_rates(state: WorkerState) -> None:
        state.rates = {"USD": 2.0}

    @registry.task("t.convert")
    def convert(ctx: Any, payload: dict[str, Any]) -> float:
        return float(payload["amount"] * ctx.state.rates["USD"])

    await registry.lifecycle.start()
    try:
        assert await run_task("t.convert", {"amount": 3}, db=None, registry=registry) == 6.0
    finally:
        await registry.lifecycle.stop()
