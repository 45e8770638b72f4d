"""One SIGTERM stops a scheduler or a worker whose broker is unreachable.

Real ``duetime scheduler`` / ``duetime worker`` processes reach RabbitMQ through a
``FaultProxy``. The broker is made unreachable either before the process starts (it is
still retrying its first connection) or after it ran normally (the connection is cut
and new ones refused, or every byte is held: a partition). One SIGTERM must then end
the process within ``EXIT_BOUND`` seconds with exit status 0 and the usual log lines
(``shutdown_requested`` and the command's last line), not the forced exit a second
signal gives (status 130). A scheduler also resigns on the way out: its election key
is gone at once, so a standby does not wait for the lease to expire.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aetcd
import asyncpg
import pytest

from tests.support.helpers import declare_queues
from tests.support.procs import ChildProcess, Processes, duetime_argv
from tests.support.proxy import FaultProxy
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.fixtures_tasks.basic"

#: Seconds one SIGTERM may take to end the process (the stop itself is sub-second; the
#: rest is slack for a loaded CI machine).
EXIT_BOUND = 5.0

FAULTS = ["refused", "cut", "partition"]


@contextlib.asynccontextmanager
async def broker_proxy(url: str) -> AsyncIterator[FaultProxy]:
    proxy = await FaultProxy.for_endpoint(_endpoint(url)).start()
    try:
        yield proxy
    finally:
        await proxy.stop()


def _endpoint(url: str) -> str:
    rest = url.split("@", 1)[-1].split("/", 1)[0]
    return rest if ":" in rest else f"{rest}:5672"


def events(proc: ChildProcess, name: str) -> list[dict[str, Any]]:
    found = []
    for line in (proc.output() + proc.errors()).splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if event.get("event") == name:
                    found.append(event)
    return found


def break_broker(proxy: FaultProxy, fault: str) -> None:
    if fault == "partition":
        proxy.blackhole(True)
    else:
        proxy.refuse(True)
        proxy.cut()


async def one_sigterm_ends_it(proc: ChildProcess, last_event: str) -> float:
    """Send one SIGTERM; assert a clean exit within EXIT_BOUND; return how long it took."""
    started = time.monotonic()
    proc.sigterm()
    code = await proc.wait(EXIT_BOUND + 10)
    took = time.monotonic() - started
    print(f"\nMEASURE sigterm_to_exit={took:.3f}s")
    assert code == 0, proc.tail(60)
    assert took <= EXIT_BOUND, f"exit took {took:.1f}s\n{proc.tail(60)}"
    assert events(proc, "shutdown_requested"), proc.tail()
    assert not events(proc, "shutdown_forced"), proc.tail()
    assert events(proc, last_event), proc.tail()
    return took


async def election_key(endpoints: str, prefix: str) -> bytes | None:
    host, _, port = endpoints.split(",")[0].rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
        kv = await client.get(f"{prefix}/leader".encode())
    return None if kv is None else kv.value


# -- the scheduler ---------------------------------------------------------------------


def scheduler_env(
    test_env: dict[str, str], dsn: str, proxy: FaultProxy, node_id: str
) -> dict[str, str]:
    return {
        **test_env,
        "DUETIME_DATABASE_URL": dsn,
        "DUETIME_AMQP_URL": proxy.route(test_env["DUETIME_AMQP_URL"]),
        "DUETIME_AMQP_TIMEOUT": "10",  # the default: a stop must not wait for it
        "DUETIME_NODE_ID": node_id,
    }


@pytest.mark.parametrize("fault", ["refused", "partition"])
async def test_scheduler_stops_on_one_sigterm_while_connecting_to_an_unreachable_broker(
    procs: Processes, test_env: dict[str, str], migrated_dsn: str, unique: str, fault: str
) -> None:
    async with broker_proxy(test_env["DUETIME_AMQP_URL"]) as proxy:
        break_broker(proxy, fault)
        env = scheduler_env(test_env, migrated_dsn, proxy, f"sb-{unique}")
        replica = procs.spawn(duetime_argv("scheduler"), name="scheduler", env=env)
        await wait_for(lambda: bool(events(replica, "leading")), 30, message=replica.tail())
        # the dispatcher's and the reconciler's publishers are connecting
        await wait_for(lambda: proxy.accepted >= 2, 20, message=replica.tail())
        await one_sigterm_ends_it(replica, "scheduler_exited")
        assert events(replica, "resigned"), replica.tail()
        prefix = env["DUETIME_ETCD_PREFIX"]
        assert await election_key(env["DUETIME_ETCD_ENDPOINTS"], prefix) is None


@pytest.mark.parametrize("fault", FAULTS)
async def test_scheduler_stops_on_one_sigterm_after_the_broker_went_away(
    procs: Processes,
    test_env: dict[str, str],
    migrated_dsn: str,
    queue: str,
    unique: str,
    fault: str,
) -> None:
    await declare_queues(migrated_dsn, queue)
    async with broker_proxy(test_env["DUETIME_AMQP_URL"]) as proxy:
        env = scheduler_env(test_env, migrated_dsn, proxy, f"sb-{unique}")
        replica = procs.spawn(duetime_argv("scheduler"), name="scheduler", env=env)
        await wait_for(lambda: bool(events(replica, "leading")), 30, message=replica.tail())
        conn = await asyncpg.connect(migrated_dsn)
        try:
            first = await insert_job(conn, queue)

            async def dispatched(job_id: int) -> bool:
                status = await conn.fetchval(
                    "SELECT status FROM duetime.jobs WHERE id = $1", job_id
                )
                return bool(status == "dispatched")

            # the dispatcher's publisher is connected and publishing
            await wait_for(lambda: dispatched(first), 30, message=replica.tail())
            accepted = proxy.accepted
            break_broker(proxy, fault)
            if fault == "partition":  # the next batch waits on a broker that answers nothing
                await insert_job(conn, queue)
            else:  # the publishers noticed and are reconnecting
                await wait_for(lambda: proxy.accepted > accepted, 20, message=replica.tail())
        finally:
            await conn.close()
        await one_sigterm_ends_it(replica, "scheduler_exited")
        assert events(replica, "resigned"), replica.tail()
        prefix = env["DUETIME_ETCD_PREFIX"]
        assert await election_key(env["DUETIME_ETCD_ENDPOINTS"], prefix) is None


async def insert_job(conn: asyncpg.Connection, queue: str) -> int:
    job_id: int = await conn.fetchval(
        "INSERT INTO duetime.jobs (task, queue) VALUES ('fixtures.record', $1) RETURNING id",
        queue,
    )
    return job_id


# -- the worker ------------------------------------------------------------------------


def worker_argv(queue: str) -> list[str]:
    return duetime_argv("worker", "--import", TASKS, "--queue", queue, "--concurrency", "2")


def worker_env(test_env: dict[str, str], proxy: FaultProxy, node_id: str) -> dict[str, str]:
    return {
        **test_env,
        "DUETIME_AMQP_URL": proxy.route(test_env["DUETIME_AMQP_URL"]),
        "DUETIME_AMQP_TIMEOUT": "10",
        "DUETIME_NODE_ID": node_id,
    }


@pytest.mark.parametrize("fault", ["refused", "partition"])
async def test_worker_stops_on_one_sigterm_while_connecting_to_an_unreachable_broker(
    procs: Processes, test_env: dict[str, str], queue: str, unique: str, fault: str
) -> None:
    async with broker_proxy(test_env["DUETIME_AMQP_URL"]) as proxy:
        break_broker(proxy, fault)
        worker = procs.spawn(
            worker_argv(queue), name="worker", env=worker_env(test_env, proxy, f"wb-{unique}")
        )
        await wait_for(lambda: proxy.accepted >= 2, 20, message=worker.tail())
        await one_sigterm_ends_it(worker, "service_start_abandoned")


@pytest.mark.parametrize("fault", FAULTS)
async def test_worker_stops_on_one_sigterm_after_the_broker_went_away(
    procs: Processes, test_env: dict[str, str], queue: str, unique: str, fault: str
) -> None:
    async with broker_proxy(test_env["DUETIME_AMQP_URL"]) as proxy:
        worker = procs.spawn(
            worker_argv(queue), name="worker", env=worker_env(test_env, proxy, f"wb-{unique}")
        )
        await wait_for(lambda: bool(events(worker, "worker_started")), 30, message=worker.tail())
        accepted = proxy.accepted
        break_broker(proxy, fault)
        if fault != "partition":
            await wait_for(lambda: proxy.accepted > accepted, 20, message=worker.tail())
        await one_sigterm_ends_it(worker, "worker_stopped")
