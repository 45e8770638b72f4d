"""``amqps://`` to RabbitMQ with a CA and a client certificate (docs/security.md).

One private node (``tests/support/rabbit.py``) with a TLS listener that verifies
clients (``verify_peer``, ``fail_if_no_peer_cert``), certificates from a throwaway CA
(``tests/support/tls.py``). duetime passes TLS through aiormq's URL parameters
(``cafile``, ``certfile``, ``keyfile``), as an operator writes them in
``DUETIME_AMQP_URL``; the URL below goes through ``load_settings`` like theirs.

- a round trip: duetime's ``Publisher`` (what the dispatcher uses) publishes a job
  with confirms over TLS, a ``Worker`` consumes it over TLS and the job succeeds;
  the broker reports both connections as TLS with the client certificate's subject;
- refusals, each a clear start-up error: no client certificate, a CA that did not
  sign the server's certificate (permanent: waiting will not help).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from scheduler.broker import connect
from scheduler.config import Settings, load_settings
from scheduler.errors import ServiceUnavailable
from scheduler.publisher import Publisher
from scheduler.store.rows import ClaimedJob
from tests.fixtures_tasks.basic import EFFECTS_TABLE
from tests.fixtures_tasks.jobs import FENCE_EPOCH, dispatched_job, effects, job_row
from tests.support import rabbit
from tests.support.rabbit import RabbitCluster, RabbitNode
from tests.support.tls import Pki, make_pki
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("amqps-pki"), client_name="duetime-worker")


@pytest.fixture(scope="module")
async def tls_broker(
    pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RabbitCluster]:
    reason = rabbit.missing()
    if reason:
        pytest.fail(f"a private RabbitMQ node cannot run here: {reason}", pytrace=False)
    base = tmp_path_factory.mktemp("amqps-node")
    async with RabbitCluster(1, pki=pki, base_dir=base) as cluster:
        yield cluster


@pytest.fixture
def tls_node(tls_broker: RabbitCluster) -> RabbitNode:
    return tls_broker.nodes[0]


def _tls_settings(settings: Settings, url: str) -> Settings:
    """``settings`` with ``amqp_url`` as an operator would set it (validated)."""
    checked = load_settings(env={"DUETIME_AMQP_URL": url}).amqp_url
    return dataclasses.replace(settings, amqp_url=checked)


def _registry() -> Registry:
    registry = Registry()

    @registry.task("t.amqps")
    async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
        await ctx.db.execute(
            f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, $3)",
            ctx.job_id,
            ctx.attempt,
            "amqps",
        )

    return registry


async def test_publish_and_consume_over_amqps_with_a_client_certificate(
    tls_broker: RabbitCluster,
    tls_node: RabbitNode,
    pki: Pki,
    settings: Settings,
    db_pool: asyncpg.Pool,
    effects_table: str,
    unique: str,
) -> None:
    url = tls_node.tls_url(cafile=pki.ca, certfile=pki.client_cert, keyfile=pki.client_key)
    s = _tls_settings(settings, url)
    assert s.amqp_url.startswith("amqps://guest:guest@localhost:")
    queue = f"amqps-{unique}"
    job = await dispatched_job(db_pool, "t.amqps", {}, queue=queue)
    row = await job_row(db_pool, job)
    epoch = int(await db_pool.fetchval(f"SELECT {FENCE_EPOCH}"))

    worker = Worker(s, queues=[queue], registry=_registry(), concurrency=2, grace_period=2)
    await worker.start()  # declares the queue over TLS, then consumes
    try:
        async with Publisher.from_settings(s, name="duetime-dispatcher") as publisher:
            claimed = ClaimedJob(job.id, job.task, queue, job.due_at, row["attempt"])
            result = await publisher.publish([claimed], epoch)
            assert [j.id for j in result.confirmed] == [job.id], result.failed

            async def done() -> bool:
                return (await job_row(db_pool, job))["status"] == "succeeded"

            await wait_for(done, timeout=20, message="the job consumed over TLS succeeded")
            rows = await tls_broker.ctl_json(
                tls_node, "list_connections", "client_properties", "port", "ssl",
                "peer_cert_subject",
            )  # fmt: skip
            seen = {}
            for r in rows:
                props = {p[0]: p[2] for p in r["client_properties"] if len(p) == 3}
                seen[str(props.get("connection_name", "")).split(":")[0]] = r
            for client in ("duetime-dispatcher", "duetime-worker"):
                conn = seen[client]
                assert conn["ssl"] is True and conn["port"] == tls_node.tls_port, conn
                assert "CN=duetime-worker" in str(conn["peer_cert_subject"]), conn
    finally:
        await worker.stop()
    assert await effects(db_pool, job, effects_table) == 1


async def test_amqps_without_a_client_certificate_is_refused(
    tls_node: RabbitNode, pki: Pki
) -> None:
    url = tls_node.tls_url(cafile=pki.ca)
    with pytest.raises(ServiceUnavailable) as info:
        await connect(load_settings(env={"DUETIME_AMQP_URL": url}).amqp_url, timeout=10)
    assert str(info.value).startswith("cannot connect to RabbitMQ at amqps://guest:***@localhost:")


async def test_amqps_with_the_wrong_ca_is_refused_for_good(tls_node: RabbitNode, pki: Pki) -> None:
    url = tls_node.tls_url(cafile=pki.wrong_ca, certfile=pki.client_cert, keyfile=pki.client_key)
    with pytest.raises(ServiceUnavailable) as info:
        await connect(url, timeout=10)
    message = str(info.value)
    assert "CERTIFICATE_VERIFY_FAILED" in message, message
    assert not info.value.transient  # a certificate that does not verify will not start to
