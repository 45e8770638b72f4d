"""``duetime worker --processes N`` as real processes (scheduler/cli/worker_processes.py):
N consuming children under one command, a killed child started again, SIGTERM stops
them all gracefully, and a child that cannot start makes the command fail instead of
looping."""

from __future__ import annotations

import json
import os
import signal
import socket

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from tests.fixtures_tasks.jobs import dispatched_job, job_row, publish, queue_depth
from tests.support.etcd import free_port
from tests.support.procs import Processes, duetime_argv
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.fixtures_tasks.basic"


def _events(text: str, event: str) -> list[dict[str, object]]:
    found = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            found.append(record)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_n_children_consume_a_killed_one_restarts_and_sigterm_stops_all(
    procs: Processes,
    test_env: dict[str, str],
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
) -> None:
    argv = duetime_argv(
        "worker", "--import", TASKS, "--queue", queue, "--concurrency", "2",
        "--processes", "2", "--grace-period", "5",
    )  # fmt: skip
    env = {**test_env, "DUETIME_NODE_ID": f"p-{unique}", "DUETIME_LOG_LEVEL": "info"}
    supervisor = procs.spawn(argv, name="supervisor", env=env)

    async def consumers(n: int) -> bool:
        return (await queue_depth(channel, queue))[1] == n

    await wait_for(lambda: consumers(2), timeout=30, message=supervisor.tail())
    started = _events(supervisor.output(), "worker_process_started")
    assert sorted(e["index"] for e in started) == [0, 1]
    pids = [int(str(e["pid"])) for e in started]

    job = await dispatched_job(db_pool, "fixtures.record", {"tag": "p"}, queue=queue)
    await publish(channel, queue, job.message(1))

    async def succeeded() -> bool:
        return (await job_row(db_pool, job))["status"] == "succeeded"

    await wait_for(succeeded, timeout=15, message=supervisor.tail())
    ledger = await db_pool.fetchval(
        "SELECT worker FROM duetime.job_ledger WHERE idempotency_key = $1", job.key
    )
    assert ledger in (f"p-{unique}-0", f"p-{unique}-1")  # a child's own node id

    os.kill(pids[0], signal.SIGKILL)

    def restarted() -> bool:
        again = _events(supervisor.output(), "worker_process_started")
        return any(e["index"] == 0 and e["restarts"] == 1 for e in again)

    await wait_for(restarted, timeout=20, message=supervisor.tail())
    exited = _events(supervisor.output(), "worker_process_exited")
    assert exited and exited[0]["exit_status"] == -signal.SIGKILL
    await wait_for(lambda: consumers(2), timeout=30, message=supervisor.tail())
    new_pid = next(
        int(str(e["pid"]))
        for e in _events(supervisor.output(), "worker_process_started")
        if e["restarts"] == 1
    )

    supervisor.sigterm()
    assert await supervisor.wait(timeout=40) == 0, supervisor.tail()
    assert not _alive(pids[1]) and not _alive(new_pid)
    assert await queue_depth(channel, queue) == (0, 0)


def _port_with_next_held() -> tuple[int, socket.socket]:
    """A free port whose successor this process holds listening: free_port() alone says
    nothing of port + 1, which another process (a parallel test's) may have taken."""
    for _ in range(100):
        port = free_port()
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind(("127.0.0.1", port + 1))
        except OSError:
            held.close()
            continue
        held.listen()
        return port, held
    raise RuntimeError("no free port with a free successor in 100 tries")


async def test_a_child_that_cannot_start_fails_the_command(
    procs: Processes, test_env: dict[str, str], queue: str, unique: str
) -> None:
    """A child that dies right after every start is given up on: the supervisor stops
    the others and exits with its status instead of restarting it forever. Here child 1
    cannot listen on its metrics port (metrics_port + 1), which the test holds."""
    port, held = _port_with_next_held()
    with held:
        argv = duetime_argv(
            "worker", "--import", TASKS, "--queue", queue, "--concurrency", "2",
            "--processes", "2", "--metrics-port", str(port),
        )  # fmt: skip
        env = {**test_env, "DUETIME_NODE_ID": f"bad-{unique}", "DUETIME_LOG_LEVEL": "info"}
        supervisor = procs.spawn(argv, name="supervisor", env=env)
        status = await supervisor.wait(timeout=100)
    assert status != 0, supervisor.tail()
    out = supervisor.output()
    gave_up = _events(out, "worker_processes_giving_up")
    assert gave_up and gave_up[0]["index"] == 1, supervisor.tail()
    assert len([e for e in _events(out, "worker_process_exited") if e["index"] == 1]) == 5


async def test_too_many_abandoned_threads_restart_the_worker_process(
    procs: Processes,
    test_env: dict[str, str],
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
) -> None:
    """``DUETIME_WORKER_MAX_ABANDONED_THREADS=0``: the first plain def handler that
    overruns its timeout (its thread still blocked) makes the worker stop gracefully and
    exit 75; under ``--processes`` the supervisor starts it again, and the job was
    settled as a failed attempt with its write rolled back."""
    argv = duetime_argv(
        "worker", "--import", TASKS, "--queue", queue, "--concurrency", "2",
        "--processes", "2", "--grace-period", "2",
    )  # fmt: skip
    env = {
        **test_env,
        "DUETIME_NODE_ID": f"ab-{unique}",
        "DUETIME_LOG_LEVEL": "info",
        "DUETIME_WORKER_MAX_ABANDONED_THREADS": "0",
    }
    supervisor = procs.spawn(argv, name="supervisor", env=env)

    async def consumers(n: int) -> bool:
        return (await queue_depth(channel, queue))[1] == n

    await wait_for(lambda: consumers(2), timeout=30, message=supervisor.tail())
    job = await dispatched_job(db_pool, "fixtures.sync_stuck", {"block": 30}, queue=queue)
    await publish(channel, queue, job.message(1))

    def exited_75() -> bool:
        return any(
            e["exit_status"] == 75 for e in _events(supervisor.output(), "worker_process_exited")
        )

    await wait_for(exited_75, timeout=30, message=supervisor.tail())
    out = supervisor.output()
    assert _events(out, "worker_abandoned_threads_exceeded"), supervisor.tail()
    assert _events(out, "worker_exit_for_restart"), supervisor.tail()
    row = await job_row(db_pool, job)
    assert (row["status"], row["attempt"]) == ("pending", 2), dict(row)
    assert "exceeded its timeout of 0.5s" in row["last_error"]
    assert (
        await db_pool.fetchval("SELECT count(*) FROM worker_test_effects WHERE job_id = $1", job.id)
        == 0
    )
    await wait_for(lambda: consumers(2), timeout=30, message=supervisor.tail())  # restarted
    supervisor.sigterm()
    assert await supervisor.wait(timeout=40) == 0, supervisor.tail()
