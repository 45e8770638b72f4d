"""Long-running services started before their dependencies are ready (scheduler.startup).

Real ``duetime worker`` / ``duetime scheduler`` processes reach RabbitMQ or PostgreSQL
through a ``FaultProxy`` that refuses connections (a service that is down or
restarting). They must keep retrying with back-off, logging every attempt, start for
real once the service is back, and stay stoppable meanwhile. A refusal that waiting
cannot fix (wrong password) must instead fail at once with one line.

This is the CI failure of a chaos test made reproducible: a worker whose queue
declaration was answered with ``INTERNAL_ERROR`` exited instead of trying again.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from tests.fixtures_tasks.basic import EFFECTS_TABLE
from tests.fixtures_tasks.jobs import (
    dispatched_job,
    effects,
    job_row,
    publish,
    queue_depth,
)
from tests.support.etcd import PrivateEtcd
from tests.support.procs import ChildProcess, Processes, duetime_argv
from tests.support.proxy import FaultProxy
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(90)

TASKS = "tests.fixtures_tasks.basic"


@contextlib.asynccontextmanager
async def refusing_proxy(url: str, default_port: int) -> AsyncIterator[FaultProxy]:
    parts = urlsplit(url)
    proxy = await FaultProxy(parts.hostname or "127.0.0.1", parts.port or default_port).start()
    proxy.refuse(True)
    try:
        yield proxy
    finally:
        await proxy.stop()


def through(
    env: dict[str, str], proxy: FaultProxy, url_key: str, *, node_id: str
) -> dict[str, str]:
    """``env`` with ``url_key``'s service reached through ``proxy``; short timeouts so
    each refused attempt fails fast."""
    return {
        **env,
        url_key: proxy.route(env[url_key]),
        "DUETIME_AMQP_TIMEOUT": "2",
        "DUETIME_DB_TIMEOUT": "2",
        "DUETIME_NODE_ID": node_id,
    }


def events(proc: ChildProcess, name: str) -> list[dict[str, Any]]:
    found = []
    for line in (proc.output() + proc.errors()).splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if event.get("event") == name:
                    found.append(event)
    return found


def worker_argv(queue: str) -> list[str]:
    return duetime_argv("worker", "--import", TASKS, "--queue", queue, "--concurrency", "2")


async def failed_attempts(proc: ChildProcess, at_least: int) -> None:
    await wait_for(
        lambda: len(events(proc, "service_start_failed")) >= at_least,
        timeout=20,
        message=f"{at_least} failed start attempts logged\n{proc.tail()}",
    )
    assert proc.running(), proc.tail()


async def test_worker_waits_for_rabbitmq_then_consumes(
    procs: Processes,
    test_env: dict[str, str],
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    unique: str,
) -> None:
    async with refusing_proxy(test_env["DUETIME_AMQP_URL"], 5672) as proxy:
        env = through(test_env, proxy, "DUETIME_AMQP_URL", node_id=f"st-{unique}")
        worker = procs.spawn(worker_argv(queue), name="worker", env=env)
        await failed_attempts(worker, 2)
        failure = events(worker, "service_start_failed")[0]
        assert failure["service"] == "worker"
        assert "RabbitMQ" in failure["error"]
        assert failure["retry_in"] > 0
        assert "guest:guest" not in worker.tail(200)  # the URL in the error is redacted

        proxy.refuse(False)  # the broker is back
        await wait_for(lambda: _consumers(channel, queue, 1), timeout=30, message=worker.tail())
        job = await dispatched_job(db_pool, "fixtures.record", queue=queue)
        await publish(channel, queue, job.message(1))

        async def succeeded() -> bool:
            return (await job_row(db_pool, job))["status"] == "succeeded"

        await wait_for(succeeded, timeout=20, message=worker.tail())
        assert await effects(db_pool, job, EFFECTS_TABLE) == 1
        assert events(worker, "service_start_recovered")
        worker.sigterm()
        assert await worker.wait(15) == 0, worker.tail()


async def _consumers(channel: AbstractChannel, queue: str, count: int) -> bool:
    return (await queue_depth(channel, queue))[1] == count


async def test_sigterm_while_retrying_is_a_clean_exit(
    procs: Processes, test_env: dict[str, str], queue: str, unique: str
) -> None:
    async with refusing_proxy(test_env["DUETIME_DATABASE_URL"], 5432) as proxy:
        env = through(test_env, proxy, "DUETIME_DATABASE_URL", node_id=f"st-{unique}")
        worker = procs.spawn(worker_argv(queue), name="worker", env=env)
        await failed_attempts(worker, 1)
        assert "PostgreSQL" in events(worker, "service_start_failed")[0]["error"]
        worker.sigterm()
        assert await worker.wait(15) == 0, worker.tail()
        assert events(worker, "service_start_abandoned"), worker.tail()
        assert not events(worker, "worker_started")


async def test_wrong_rabbitmq_password_fails_at_once_with_one_line(
    procs: Processes, test_env: dict[str, str], queue: str
) -> None:
    parts = urlsplit(test_env["DUETIME_AMQP_URL"])
    netloc = f"{parts.username or 'guest'}:wrong-secret@{parts.hostname}:{parts.port or 5672}"
    bad = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    worker = procs.spawn(
        worker_argv(queue), name="worker", env={**test_env, "DUETIME_AMQP_URL": bad}
    )
    assert await worker.wait(30) == 1, worker.tail()
    text = worker.output() + worker.errors()
    assert "cannot connect to RabbitMQ" in text
    assert "wrong-secret" not in text
    assert not events(worker, "service_start_failed")  # not retried: waiting cannot fix it
    assert "Traceback" not in text


async def test_a_missing_rabbitmq_vhost_fails_at_once_with_one_line(
    procs: Processes, test_env: dict[str, str], queue: str, unique: str
) -> None:
    parts = urlsplit(test_env["DUETIME_AMQP_URL"])
    bad = urlunsplit((parts.scheme, parts.netloc, f"/no-such-vhost-{unique}", parts.query, ""))
    worker = procs.spawn(
        worker_argv(queue), name="worker", env={**test_env, "DUETIME_AMQP_URL": bad}
    )
    assert await worker.wait(30) == 1, worker.tail()
    text = worker.output() + worker.errors()
    assert "the broker refused the vhost" in text, worker.tail()
    assert not events(worker, "service_start_failed")  # not retried: waiting cannot fix it
    assert "Traceback" not in text


async def test_scheduler_waits_for_postgresql_then_leads(
    procs: Processes, test_env: dict[str, str], migrated_dsn: str, unique: str
) -> None:
    async with refusing_proxy(migrated_dsn, 5432) as proxy:
        env = through(
            {**test_env, "DUETIME_DATABASE_URL": migrated_dsn},
            proxy,
            "DUETIME_DATABASE_URL",
            node_id=f"st-{unique}",
        )
        replica = procs.spawn(duetime_argv("scheduler"), name="scheduler", env=env)
        await failed_attempts(replica, 2)
        assert events(replica, "service_start_failed")[0]["service"] == "scheduler"
        assert not events(replica, "leading")

        proxy.refuse(False)  # PostgreSQL is back
        await wait_for(lambda: bool(events(replica, "leading")), timeout=30, message=replica.tail())
        conn = await asyncpg.connect(migrated_dsn)
        try:
            fence = await conn.fetchval("SELECT epoch FROM duetime.leader_fence")
        finally:
            await conn.close()
        assert fence == events(replica, "leading")[0]["epoch"]
        replica.sigterm()
        assert await replica.wait(15) == 0, replica.tail()


@pytest.mark.parametrize(
    ("credentials", "expected"),
    [
        ({"DUETIME_ETCD_USERNAME": "root", "DUETIME_ETCD_PASSWORD": "wrong-etcd-pw"},
         "refused user 'root'"),
        ({}, "refused no user name"),
        ({"DUETIME_ETCD_USERNAME": "norole", "DUETIME_ETCD_PASSWORD": "norole-etcd-pw"},
         "permission denied"),
    ],
    ids=["wrong-password", "no-credentials", "no-role"],
)  # fmt: skip
async def test_etcd_refusing_the_credentials_fails_at_once_with_one_line(
    procs: Processes,
    test_env: dict[str, str],
    unique: str,
    credentials: dict[str, str],
    expected: str,
) -> None:
    async with PrivateEtcd() as etcd:
        await etcd.enable_auth("root-etcd-pw", norole="norole-etcd-pw")
        env = {
            **test_env,
            "DUETIME_ETCD_ENDPOINTS": etcd.endpoint,
            "DUETIME_NODE_ID": f"ea-{unique}",
            **credentials,
        }
        replica = procs.spawn(
            duetime_argv("scheduler"), name="scheduler", env=env, separate_stderr=True
        )
        assert await replica.wait(20) == 1, replica.tail()
    # structlog's JSON lines go to stderr too; the rest is what an operator reads
    errors = [x for x in replica.errors().strip().splitlines() if not x.startswith("{")]
    assert len(errors) == 1, replica.tail()
    assert errors[0].startswith("duetime: error: etcd at "), errors[0]
    assert expected in errors[0], errors[0]
    assert "check etcd_username/etcd_password" in errors[0]
    text = replica.output() + replica.errors()
    assert "etcd-pw" not in text  # neither password, in any line
    assert not events(replica, "election_etcd_error")  # not retried: waiting cannot fix it
    assert not events(replica, "campaign_failed")
    assert "Traceback" not in text
