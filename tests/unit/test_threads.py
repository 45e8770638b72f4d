"""The handler thread pool (workers/threads.py) and the synchronous ctx bridge
(workers/sync_db.py), without services: bounded, threads reused, an abandoned thread
replaced and counted, ``on_exhausted`` past the bound, late calls refused."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from workers import Registry, SyncJobContext
from workers.sync_db import AttemptAbandoned, Bridge
from workers.threads import ThreadRunner

pytestmark = pytest.mark.timeout(30)


async def test_runs_are_bounded_and_threads_reused() -> None:
    runner = ThreadRunner(2)
    lock = threading.Lock()
    running = peak = 0
    names: set[str] = set()

    def work(n: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        threading.Event().wait(0.02)
        with lock:
            running -= 1
            names.add(threading.current_thread().name)
        return n * 2

    try:
        assert await asyncio.gather(*(runner.run(work, n) for n in range(10))) == [
            n * 2 for n in range(10)
        ]
    finally:
        runner.close()
    assert peak == 2 and len(names) == 2


async def test_an_abandoned_thread_is_replaced_counted_and_reaped() -> None:
    exhausted: list[int] = []
    runner = ThreadRunner(1, max_abandoned=0, on_exhausted=lambda: exhausted.append(1))
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await runner.run(release.wait, 10)
        assert runner.abandoned == 1 and exhausted == [1]
        # the one slot is free: a replacement thread runs the next call
        assert await asyncio.wait_for(runner.run(lambda: "next"), 5) == "next"
        release.set()
        for _ in range(100):
            if runner.abandoned == 0:
                break
            await asyncio.sleep(0.02)
        assert runner.abandoned == 0
    finally:
        release.set()
        runner.close()


async def test_a_def_returning_an_awaitable_is_an_error() -> None:
    async def coro() -> None:
        return None

    runner = ThreadRunner(1)
    try:
        with pytest.raises(TypeError, match="declare it 'async def'"):
            await runner.run(coro)
    finally:
        runner.close()


async def test_the_bridge_refuses_calls_once_closed_and_from_the_loop() -> None:
    bridge = Bridge(asyncio.get_running_loop(), timeout=5)

    async def answer() -> int:
        return 42

    assert await asyncio.to_thread(bridge.call, "x", answer()) == 42
    with pytest.raises(RuntimeError, match="plain 'def' handlers"):
        bridge.call("x", answer())
    bridge.close()
    with pytest.raises(AttemptAbandoned):
        await asyncio.to_thread(bridge.call, "x", answer())


async def test_run_task_runs_a_plain_def_handler_with_a_sync_ctx() -> None:
    from duetime.testing import run_task

    class FakeDB:
        async def fetchval(self, query: str, *args: Any) -> Any:
            return (query, args)

    registry = Registry()

    @registry.task("t.sync")
    def sync(ctx: SyncJobContext, payload: dict[str, Any]) -> Any:
        return ctx.db.fetchval("SELECT $1", payload["x"]), ctx.heartbeat(), ctx.job_id

    got = await run_task("t.sync", {"x": 1}, db=FakeDB(), registry=registry, job_id=3)
    assert got == (("SELECT $1", (1,)), True, 3)
