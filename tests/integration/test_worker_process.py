"""``duetime worker`` as a real process: crash (kill -9), graceful SIGTERM, forced exit.

The handlers come from ``tests.fixtures_tasks.basic`` (``--import``). ``fixtures.record``
inserts its effect through ``ctx.db`` first, then heartbeats — the test's signal that the
handler is running with an uncommitted effect — then waits while a file exists / sleeps.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from tests.fixtures_tasks.basic import EFFECTS_TABLE
from tests.fixtures_tasks.jobs import (
    DispatchedJob,
    dispatched_job,
    effects,
    job_row,
    publish,
    queue_depth,
)
from tests.support.etcd import free_port
from tests.support.procs import Processes, duetime_argv
from tests.support.proxy import FaultProxy
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)

TASKS = "tests.fixtures_tasks.basic"


def worker_argv(queue: str, *, concurrency: int, grace: float) -> list[str]:
    return duetime_argv(
        "worker", "--import", TASKS, "--queue", queue,
        "--concurrency", str(concurrency), "--grace-period", str(grace),
    )  # fmt: skip


def worker_env(test_env: dict[str, str], node_id: str) -> dict[str, str]:
    return {**test_env, "DUETIME_NODE_ID": node_id, "DUETIME_LOG_LEVEL": "info"}


async def consumers_are(channel: AbstractChannel, queue: str, count: int) -> bool:
    return (await queue_depth(channel, queue))[1] == count


async def running_handlers(pool: asyncpg.Pool, jobs: list[DispatchedJob]) -> list[int]:
    rows = await pool.fetch(
        "SELECT id FROM duetime.jobs WHERE id = ANY($1::bigint[]) AND heartbeat_at IS NOT NULL",
        [j.id for j in jobs],
    )
    return sorted(r["id"] for r in rows)


async def test_kill9_mid_handler_redelivers_to_another_worker_effect_once(
    procs: Processes,
    test_env: dict[str, str],
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
    tmp_path: Path,
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    job = await dispatched_job(
        db_pool, "fixtures.record", {"beat": True, "hold_while_exists": str(hold)}, queue=queue
    )
    argv = worker_argv(queue, concurrency=2, grace=5)
    first = procs.spawn(argv, name="worker-a", env=worker_env(test_env, f"a-{unique}"))
    await wait_for(lambda: consumers_are(channel, queue, 1), timeout=20, message=first.tail())
    await publish(channel, queue, job.message(1))
    # the handler is running: its effect is inserted (uncommitted) and it heartbeated
    await wait_for(lambda: running_handlers(db_pool, [job]), timeout=15)
    second = procs.spawn(argv, name="worker-b", env=worker_env(test_env, f"b-{unique}"))
    await wait_for(lambda: consumers_are(channel, queue, 2), timeout=20, message=second.tail())

    first.kill9()
    hold.unlink()  # whoever runs the job now may finish

    async def succeeded() -> bool:
        return (await job_row(db_pool, job))["status"] == "succeeded"

    await wait_for(succeeded, timeout=20, message=f"redelivery; worker-b:\n{second.tail()}")
    assert await effects(db_pool, job, EFFECTS_TABLE) == 1  # the killed attempt rolled back
    ledger = await db_pool.fetchrow(
        "SELECT worker, attempt FROM duetime.job_ledger WHERE idempotency_key = $1", job.key
    )
    assert dict(ledger) == {"worker": f"b-{unique}", "attempt": 1}
    assert await second.stop(timeout=15) == 0
    assert await queue_depth(channel, queue) == (0, 0)


async def test_sigterm_lets_in_flight_handlers_finish_and_exits_zero(
    procs: Processes,
    test_env: dict[str, str],
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
) -> None:
    jobs = [
        await dispatched_job(
            db_pool, "fixtures.record", {"beat": True, "sleep": 2, "tag": str(i)}, queue=queue
        )
        for i in range(8)
    ]
    worker = procs.spawn(
        worker_argv(queue, concurrency=5, grace=30),
        name="worker",
        env=worker_env(test_env, f"w-{unique}"),
    )
    await wait_for(lambda: consumers_are(channel, queue, 1), timeout=20, message=worker.tail())
    for job in jobs:
        await publish(channel, queue, job.message(1))

    async def five_running() -> bool:
        return len(await running_handlers(db_pool, jobs)) == 5

    await wait_for(five_running, timeout=15, message=worker.tail())
    in_flight = await running_handlers(db_pool, jobs)
    worker.sigterm()
    assert await worker.wait(timeout=20) == 0, worker.tail()

    for job in jobs:
        row = await job_row(db_pool, job)
        if job.id in in_flight:  # finished within the grace period
            assert row["status"] == "succeeded", dict(row)
            assert await effects(db_pool, job, EFFECTS_TABLE) == 1
        else:  # never started: still dispatched, its message still in the queue
            assert row["status"] == "dispatched", dict(row)
            assert await effects(db_pool, job, EFFECTS_TABLE) == 0
    assert await queue_depth(channel, queue) == (3, 0)  # nothing lost, nothing unacked
    assert "worker_stopped" in worker.output()


async def test_second_signal_exits_at_once_and_the_message_survives(
    procs: Processes,
    test_env: dict[str, str],
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
    tmp_path: Path,
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    job = await dispatched_job(
        db_pool, "fixtures.record", {"beat": True, "hold_while_exists": str(hold)}, queue=queue
    )
    later = await dispatched_job(db_pool, "fixtures.record", {"beat": True}, queue=queue)
    worker = procs.spawn(
        worker_argv(queue, concurrency=2, grace=60),
        name="worker",
        env=worker_env(test_env, f"w-{unique}"),
    )
    await wait_for(lambda: consumers_are(channel, queue, 1), timeout=20, message=worker.tail())
    await publish(channel, queue, job.message(1))
    await wait_for(lambda: running_handlers(db_pool, [job]), timeout=15)
    worker.sigterm()
    # (a quorum queue keeps counting a cancelled consumer while it holds unacked messages,
    # so the worker's own log line is the observable for "stopped consuming")
    await wait_for(lambda: "consuming_stopped" in worker.output(), timeout=10)
    await publish(channel, queue, later.message(1))  # must not be delivered any more
    assert worker.running()  # still inside its 60 s grace period
    worker.sigterm()
    assert await worker.wait(timeout=10) == 130
    await wait_for(lambda: _ready(channel, queue, 2), timeout=10)  # the held one requeued
    for waiting in (job, later):
        row = await job_row(db_pool, waiting)
        assert (row["status"], row["attempt"], row["heartbeat_at"] is None) == (
            "dispatched",
            1,
            waiting is later,
        )
        assert await effects(db_pool, waiting, EFFECTS_TABLE) == 0


async def _ready(channel: AbstractChannel, queue: str, count: int) -> bool:
    return (await queue_depth(channel, queue))[0] == count


def test_bad_import_is_one_clear_error(test_env: dict[str, str]) -> None:
    result = subprocess.run(
        duetime_argv("worker", "--import", "tests.fixtures_tasks.no_such_module"),
        env=test_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--import tests.fixtures_tasks.no_such_module" in result.stderr
    assert "Traceback" not in result.stderr


async def _readyz(port: int) -> tuple[int, dict[str, Any]]:
    async with asyncio.timeout(5):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


async def test_readyz_means_consuming_with_pools_open(
    procs: Processes, test_env: dict[str, str], channel: AbstractChannel, queue: str
) -> None:
    """A worker whose broker is a closed port retries its start and is not ready (503,
    ``amqp`` and ``consuming`` failing, never ``"checks": {}``); once the broker answers
    it consumes and is ready (200); when the broker connection is lost it is not ready
    again, until it has reconnected."""
    amqp = urlsplit(test_env["DUETIME_AMQP_URL"])
    proxy = FaultProxy(amqp.hostname or "127.0.0.1", amqp.port or 5672, listen_port=free_port())
    metrics_port = free_port()
    env = {
        **worker_env(test_env, "w-ready"),
        "DUETIME_AMQP_URL": proxy.route(test_env["DUETIME_AMQP_URL"]),
        "DUETIME_METRICS_PORT": str(metrics_port),
    }
    worker = procs.spawn(worker_argv(queue, concurrency=2, grace=1), name="w-ready", env=env)

    async def answer() -> tuple[int, dict[str, Any]] | None:
        try:
            return await _readyz(metrics_port)
        except OSError:
            return None  # not listening yet

    async def status_is(code: int) -> tuple[int, dict[str, Any]] | None:
        got = await answer()
        return got if got is not None and got[0] == code else None

    code, body = await wait_for(answer, timeout=20, message=worker.tail())
    assert code == 503, body
    assert {"amqp", "consuming"} <= set(body["failing"]), body
    assert body["checks"]["amqp"]["error"].startswith("NotReady: no broker connection"), body
    assert await consumers_are(channel, queue, 0)

    async with proxy:  # the broker becomes reachable: the start retry succeeds
        _, ready = await wait_for(lambda: status_is(200), timeout=30, message=worker.tail())
        assert ready["status"] == "ready" and set(ready["checks"]) == {"amqp", "consuming", "db"}
        await wait_for(lambda: consumers_are(channel, queue, 1), timeout=10)
        proxy.refuse(True)
        proxy.cut()  # the connection is lost and cannot come back yet
        _, lost = await wait_for(lambda: status_is(503), timeout=10, message=worker.tail())
        assert "amqp" in lost["failing"], lost
        proxy.refuse(False)  # it reconnects (every second) and consumes again
        await wait_for(lambda: status_is(200), timeout=30, message=worker.tail())
        assert worker.running()
        worker.sigterm()
        assert await worker.wait(15) == 0
