"""``duetime status``: figures against a real database and etcd, and its exit codes.

Each test gets its own migrated database (``migrated_dsn``) so the counts are exact, and
its own etcd prefix (``unique``). The election key and the fence row are written the
way a leader writes them (DESIGN §4: value = node id, epoch = create_revision), so the
command is judged on exactly what it will see in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aetcd
import asyncpg
import pytest
from aio_pika.abc import AbstractChannel

from scheduler import db
from scheduler.broker import queue_name
from scheduler.status import election_key
from scheduler.store.status import StatusStore
from tests.fixtures_tasks.jobs import declare
from tests.support.cli import Run, run_duetime
from tests.support.etcd import free_port
from tests.support.helpers import declare_queues
from tests.support.procs import Processes, duetime_argv
from tests.support.wait import wait_for


@dataclass
class Cluster:
    dsn: str
    pool: asyncpg.Pool
    etcd: aetcd.Client
    prefix: str
    env: dict[str, str]
    lease: object | None = None

    async def elect(self, node: str, *, renewed_ago: float = 0.0) -> int:
        """Write the election key and the fence as a freshly elected leader would."""
        self.lease = await self.etcd.lease(30)
        await self.etcd.put(election_key(self.prefix).encode(), node.encode(), lease=self.lease)
        kv = await self.etcd.get(election_key(self.prefix).encode())
        assert kv is not None
        await self.pool.execute(
            "UPDATE duetime.leader_fence SET epoch = $1, leader_node = $2,"
            " elected_at = now() - interval '5 minutes',"
            " renewed_at = now() - make_interval(secs => $3) WHERE shard = 0",
            kv.create_revision,
            node,
            renewed_ago,
        )
        return int(kv.create_revision)

    async def resign(self) -> None:
        await self.etcd.delete(election_key(self.prefix).encode())

    async def run(self, *args: str, timeout: float = 30.0) -> Run:
        return await run_duetime(self.env, "status", *args, timeout=timeout)

    async def status_json(self, *args: str) -> tuple[int, dict]:
        code, out, err = await self.run("--json", *args)
        assert code in (0, 1), f"exit {code}: {err}"
        return code, json.loads(out)


@pytest.fixture
async def cluster(
    migrated_dsn: str, etcd_endpoints: str, test_env: dict[str, str], unique: str
) -> AsyncIterator[Cluster]:
    pool = await db.create_pool(migrated_dsn, max_size=2)
    host, _, port = etcd_endpoints.split(",")[0].rpartition(":")
    client = aetcd.Client(host=host, port=int(port), timeout=5)
    prefix = f"duetime-test/{unique}"
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn, "DUETIME_ETCD_PREFIX": prefix}
    env.pop("DUETIME_LOG_FORMAT", None)
    env["DUETIME_LOG_LEVEL"] = "warning"
    cl = Cluster(migrated_dsn, pool, client, prefix, env)
    try:
        yield cl
    finally:
        with contextlib.suppress(Exception):
            await client.delete_prefix(prefix.encode())
        await client.close()
        await pool.close()


async def _seed_jobs(pool: asyncpg.Pool) -> None:
    """Jobs in every state, over two queues (both declared), with known ages."""
    await declare_queues(pool, "emails")
    await pool.execute(
        """
        INSERT INTO duetime.jobs (task, queue, due_at, status, dispatched_at, finished_at,
                                  dispatch_epoch)
        SELECT v.*, CASE WHEN v.status = 'dispatched' THEN
                    (SELECT epoch FROM duetime.leader_fence WHERE shard = 0) END
          FROM (VALUES
          ('t', 'default', now() + interval '1 hour',    'pending',    NULL, NULL),
          ('t', 'default', now() + interval '2 hours',   'pending',    NULL, NULL),
          ('t', 'default', now() - interval '5 seconds', 'pending',    NULL, NULL),
          ('t', 'default', now() - interval '1 second',  'pending',    NULL, NULL),
          ('t', 'default', now() - interval '1 minute',  'dispatched', now(), NULL),
          ('t', 'default', now() - interval '1 minute',  'succeeded',  now(), now()),
          ('t', 'default', now() - interval '1 hour',    'dead',       now(), now() - interval '10 minutes'),
          ('t', 'default', now() - interval '3 hours',   'dead',       now(), now() - interval '2 hours'),
          ('t', 'emails',  now() - interval '20 seconds','pending',    NULL, NULL),
          ('t', 'emails',  now() - interval '1 minute',  'cancelled',  NULL, now()),
          ('t', 'emails',  now() - interval '1 minute',  'dead',       now(), now())
          ) AS v (task, queue, due_at, status, dispatched_at, finished_at)
        """  # noqa: E501
    )

    # a retried job: due long ago, but its run time is pushed into the future
    await pool.execute(
        "INSERT INTO duetime.jobs (task, queue, due_at, run_at) "
        "VALUES ('t', 'emails', now() - interval '1 day', now() + interval '1 minute')"
    )


def _queues(report: dict) -> dict[str, dict]:
    return {q["queue"]: q for q in report["queues"]}


async def test_status_json_reports_leader_queues_and_exit_0(cluster: Cluster) -> None:
    await _seed_jobs(cluster.pool)
    epoch = await cluster.elect("node-a")
    code, report = await cluster.status_json("--max-backlog-age", "60")
    assert code == 0, report["problems"]
    assert report["healthy"] is True and report["problems"] == []
    assert report["leader"]["leader_node"] == "node-a"
    assert report["leader"]["epoch"] == epoch
    assert 290 <= report["leader"]["elected_age"] <= 330
    assert report["leader"]["renewed_age"] < 10
    assert report["etcd"]["reachable"] is True
    assert report["etcd"]["leader"] == "node-a" and report["etcd"]["epoch"] == epoch
    assert 0 < report["etcd"]["lease_remaining"] <= 30
    assert report["warnings"] == []

    queues = _queues(report)
    default, emails = queues["default"], queues["emails"]
    assert (default["pending"], default["due_now"], default["dispatched"]) == (4, 2, 1)
    assert default["dead_last_hour"] == 1  # the one dead 2 hours ago is not counted
    assert 5 <= default["oldest_overdue"] < 15
    assert (emails["pending"], emails["due_now"], emails["dispatched"]) == (2, 1, 0)
    assert emails["dead_last_hour"] == 1
    assert 20 <= emails["oldest_overdue"] < 30  # the retried job is not due: run_at wins
    assert report["thresholds"] == {
        "max_backlog_age": 60.0,
        "leader_stale_after": 6.0,
        "max_unstarted_age": 60.0,
    }
    assert report["broker"]["reachable"] is True
    assert default["unstarted"] == 1 and default["oldest_unstarted"] < 10


async def test_backlog_older_than_threshold_exits_1(cluster: Cluster) -> None:
    await _seed_jobs(cluster.pool)
    await cluster.elect("node-a")
    code, report = await cluster.status_json("--max-backlog-age", "10")
    assert code == 1
    assert [p["code"] for p in report["problems"]] == ["backlog_too_old"]
    assert "queue emails" in report["problems"][0]["message"]


async def test_no_leader_key_exits_1(cluster: Cluster) -> None:
    await cluster.elect("node-a")
    await cluster.resign()
    code, report = await cluster.status_json()
    assert code == 1
    assert [p["code"] for p in report["problems"]] == ["no_leader"]
    assert report["etcd"]["reachable"] is True and report["etcd"]["leader"] is None


async def test_never_elected_exits_1_with_human_output(cluster: Cluster) -> None:
    code, out, _ = await cluster.run()
    assert code == 1
    assert "no leader has ever fenced the database" in out
    assert out.rstrip().splitlines()[-1].startswith("status: UNHEALTHY: no leader")


async def test_stale_fence_exits_1_even_with_key_present(cluster: Cluster) -> None:
    # TTL is 2 s in the test environment: stale after 6 s without a renewal
    await cluster.elect("node-a", renewed_ago=7.0)
    code, report = await cluster.status_json()
    assert code == 1
    assert [p["code"] for p in report["problems"]] == ["leader_stale"]


async def test_etcd_unreachable_is_a_warning_and_bounded(cluster: Cluster) -> None:
    await cluster.elect("node-a")

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.read()  # accept and never answer: a hung etcd
        writer.close()

    blackhole = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = blackhole.sockets[0].getsockname()[1]
    try:
        started = time.monotonic()
        code, report = await cluster.status_json(
            "--etcd-endpoints", f"127.0.0.1:{port}", "--etcd-timeout", "0.5"
        )
        elapsed = time.monotonic() - started
    finally:
        blackhole.close()
    assert code == 0, report["problems"]
    assert report["etcd"]["reachable"] is False and report["etcd"]["error"]
    assert [w["code"] for w in report["warnings"]] == ["etcd_unreachable"]
    assert elapsed < 10, elapsed


async def test_human_output_when_healthy(cluster: Cluster) -> None:
    await _seed_jobs(cluster.pool)
    epoch = await cluster.elect("node-a")
    code, out, err = await cluster.run("--max-backlog-age", "120")
    assert code == 0, out + err
    assert f"node-a  epoch {epoch}" in out
    assert "QUEUE" in out and "emails" in out
    assert out.rstrip().endswith("status: OK")


async def test_database_unreachable_json(cluster: Cluster) -> None:
    code, out, _ = await cluster.run(
        "--json", "--database-url", "postgresql://u:topsecret@127.0.0.1:1/none"
    )
    assert code == 1
    report = json.loads(out)
    assert report["problems"][0]["code"] == "database_unreachable"
    assert "topsecret" not in out


async def test_schedules_summary(cluster: Cluster) -> None:
    store = StatusStore(cluster.pool)
    present = await cluster.pool.fetchval("SELECT to_regclass('duetime.schedules') IS NOT NULL")
    if not present:
        assert (await store.snapshot()).schedules is None
        # migration 0002 (schedules) is not there yet: a stand-in with the columns read
        await cluster.pool.execute(
            "CREATE TABLE duetime.schedules (id bigserial PRIMARY KEY, name text UNIQUE,"
            " task text, cron text, paused boolean NOT NULL DEFAULT false,"
            " next_fire_at timestamptz)"
        )
    await cluster.pool.execute(
        """
        INSERT INTO duetime.schedules (name, task, cron, paused, next_fire_at) VALUES
          ('nightly', 't', '0 3 * * *', false, now() + interval '2 hours'),
          ('minutely', 't', '* * * * *', false, now() + interval '30 seconds'),
          ('off', 't', '* * * * *', true, now() + interval '1 second')
        """
    )
    snap = await store.snapshot()
    assert snap.schedules is not None
    assert (snap.schedules.total, snap.schedules.paused) == (3, 1)
    assert [u.name for u in snap.schedules.upcoming] == ["minutely", "nightly"]
    assert snap.schedules.next_fire_at == snap.schedules.upcoming[0].next_fire_at
    _, report = await cluster.status_json()
    assert report["schedules"]["total"] == 3
    assert report["schedules"]["upcoming"][0]["name"] == "minutely"


async def test_waiting_jobs_are_counted(cluster: Cluster) -> None:
    """Workflows (migration 0025): jobs waiting for their dependencies, in the snapshot and
    ``--json``; None on a schema before it."""
    store = StatusStore(cluster.pool)
    if not await cluster.pool.fetchval(
        "SELECT to_regclass('duetime.jobs_waiting_idx') IS NOT NULL"
    ):
        assert (await store.snapshot()).waiting is None
        return
    before = (await store.snapshot()).waiting or 0
    first = await cluster.pool.fetchval(
        "INSERT INTO duetime.jobs (task, due_at) VALUES ('t', now() + interval '1 day') "
        "RETURNING id"
    )
    await cluster.pool.execute(
        "INSERT INTO duetime.jobs (task, depends_on) VALUES ('t', ARRAY[$1::bigint])", first
    )
    assert (await store.snapshot()).waiting == before + 1
    _, report = await cluster.status_json()
    assert report["waiting"] == before + 1


async def test_help_documents_exit_codes() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
    out = await run_duetime(env, "status", "--help")
    assert out.code == 0
    assert "exit codes:" in out.out
    for line in ("0  healthy", "1  unhealthy", "2  bad flags"):
        assert line in out.out


async def _dispatched_long_ago(pool: asyncpg.Pool, queue: str, count: int) -> None:
    """``count`` jobs dispatched two minutes ago that no worker has started."""
    await pool.execute(
        "INSERT INTO duetime.jobs (task, queue, due_at, status, dispatched_at, dispatch_epoch) "
        "SELECT 't', $1, now() - interval '3 minutes', 'dispatched', "
        "now() - interval '2 minutes', (SELECT epoch FROM duetime.leader_fence WHERE shard = 0) "
        "FROM generate_series(1, $2)",
        queue,
        count,
    )


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_broker_unreachable_is_unhealthy_in_status_and_dashboard(
    cluster: Cluster, procs: Processes, unique: str
) -> None:
    """RabbitMQ down and 14 jobs dispatched: nothing executes. ``duetime status`` exits 1
    saying why in its last line, and the dashboard's cluster page does not say Healthy."""
    await cluster.elect("node-a")
    await _dispatched_long_ago(cluster.pool, f"q-{unique}", 14)
    closed = f"amqp://guest:guest@127.0.0.1:{free_port()}/"
    code, report = await cluster.status_json("--amqp-url", closed, "--broker-timeout", "2")
    assert code == 1
    assert [p["code"] for p in report["problems"]] == ["broker_unreachable"]
    assert report["broker"]["reachable"] is False
    assert _queues(report)[f"q-{unique}"]["unstarted"] == 14
    await cluster.elect("node-a")  # the fence is stale after 3 x TTL = 6 s
    code, out, _ = await cluster.run("--amqp-url", closed)
    assert code == 1
    assert out.rstrip().splitlines()[-1].startswith("status: UNHEALTHY: RabbitMQ unreachable (")
    assert "broker     unreachable: " in out

    port = free_port()
    dashboard = procs.spawn(
        duetime_argv("dashboard", "--listen", f"127.0.0.1:{port}"),
        name="dashboard",
        env={**cluster.env, "DUETIME_AMQP_URL": closed},
    )
    url = f"http://127.0.0.1:{port}"

    async def page() -> str | None:
        try:
            status, body = await asyncio.to_thread(_get, url + "/cluster")
        except OSError:
            return None  # not listening yet
        return body if status == 200 else None

    await wait_for(page, timeout=20, message=dashboard.tail())
    await cluster.elect("node-a")
    body = await page()
    assert body is not None
    assert "Unhealthy: RabbitMQ unreachable" in body
    assert "Healthy:" not in body


async def test_dispatched_jobs_nobody_consumes_are_unhealthy(
    cluster: Cluster, channel: AbstractChannel, unique: str
) -> None:
    """Jobs dispatched 2 minutes ago that no worker started, on a queue without
    consumers: exit 1 (``no_consumers``). With a consumer on the queue the same jobs are
    only a warning (workers busy), and the consumer count is reported."""
    queue = f"q-{unique}"
    await cluster.elect("node-a")
    await _dispatched_long_ago(cluster.pool, queue, 14)
    code, report = await cluster.status_json()
    assert code == 1, report
    assert [p["code"] for p in report["problems"]] == ["no_consumers"]
    assert f"queue {queue}: 14 dispatched job(s) not started" in report["problems"][0]["message"]
    row = _queues(report)[queue]
    assert row["unstarted"] == 14 and 110 <= row["oldest_unstarted"] < 200
    assert {"queue": queue, "ready": None, "consumers": None} in report["broker"]["queues"]
    await cluster.elect("node-a")
    code, out, _ = await cluster.run()
    assert code == 1
    last = out.rstrip().splitlines()[-1]
    assert last.startswith(f"status: UNHEALTHY: queue {queue}: 14 dispatched job(s) not started")
    assert last.endswith("and no worker consumes it")

    async def hold(message: object) -> None:
        """Receive and never settle: a worker busy with its prefetch."""

    await declare(channel, queue)
    consumer = await (await channel.get_queue(queue_name(queue))).consume(hold)
    try:
        await cluster.elect("node-a")
        code, report = await cluster.status_json()
        assert code == 0, report["problems"]
        assert [w["code"] for w in report["warnings"]] == ["unstarted_too_old"]
        assert {"queue": queue, "ready": 0, "consumers": 1} in report["broker"]["queues"]
        await cluster.elect("node-a")
        code, report = await cluster.status_json("--max-unstarted-age", "300")
        assert code == 0 and report["warnings"] == []
    finally:
        await (await channel.get_queue(queue_name(queue))).cancel(consumer)
