"""Declared queues (migration 0008, the broker fan-out issue): a producer's ``queue``
value never makes RabbitMQ create anything; only queues an operator declared
(``duetime queues add``) are dispatched, the others' jobs are held and counted.

Real PostgreSQL (a database per test: the dispatcher claims every due job in it) and
RabbitMQ (the session vhost; the two or three queue names a test uses, deleted after).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import aiormq
import asyncpg
import pytest
from prometheus_client import REGISTRY

from scheduler import broker, db
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher, DispatcherConfig
from scheduler.migrate import migrate
from scheduler.sql import migrations
from scheduler.store.dispatch import Q, claim_sql
from scheduler.store.fence import FenceStore
from scheduler.store.queues import QueueStore
from tests.support.cli import run_duetime
from tests.support.helpers import declare_queues, delete_job_queue
from tests.support.procs import Processes, duetime_argv
from tests.support.wait import wait_for


async def broker_has_queue(amqp_url: str, queue: str) -> bool:
    """Whether ``duetime.<queue>`` exists: a passive declare, on a connection of its own
    (a failed passive declare closes the channel)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        try:
            await channel.declare_queue(broker.queue_name(queue), passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True
    finally:
        await connection.close()


async def delete_broker_queues(amqp_url: str, *queues: str) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        for queue in queues:
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await delete_job_queue(channel, queue)


async def insert_job(pool: asyncpg.Pool, queue: str) -> int:
    return int(
        await pool.fetchval(
            "INSERT INTO duetime.jobs (task, queue) VALUES ('t.held', $1) RETURNING id", queue
        )
    )


async def statuses(pool: asyncpg.Pool) -> dict[str, str]:
    rows = await pool.fetch("SELECT queue, status FROM duetime.jobs")
    return {r["queue"]: r["status"] for r in rows}


def held_gauge() -> float | None:
    labels = {"shard": "main", "reason": "queue_undeclared"}
    return REGISTRY.get_sample_value("duetime_jobs_held", labels)


def paused_gauge(queue: str) -> float | None:
    return REGISTRY.get_sample_value("duetime_queue_paused", {"shard": "main", "queue": queue})


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [r.msg for r in caplog.records if isinstance(r.msg, dict) and r.msg.get("event") == name]


@pytest.fixture
async def pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(migrated_dsn, max_size=6)
    try:
        assert await FenceStore(pool).advance(1, "test-node")
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def names(unique: str, amqp_url: str) -> AsyncIterator[tuple[str, str]]:
    """A declared and an undeclared queue name; their broker queues deleted after."""
    declared, undeclared = f"decl-{unique}", f"undecl-{unique}"
    yield declared, undeclared
    await delete_broker_queues(amqp_url, declared, undeclared)


async def test_job_for_an_undeclared_queue_is_held_not_published_and_released_by_add(
    pool: asyncpg.Pool,
    migrated_dsn: str,
    settings: Settings,
    names: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    declared, undeclared = names
    settings = dataclasses.replace(settings, database_url=migrated_dsn)
    await declare_queues(pool, declared)
    await insert_job(pool, declared)
    await insert_job(pool, undeclared)
    dispatcher = Dispatcher(
        DutyContext.standalone(settings, pool),
        config=DispatcherConfig(backlog_interval=0.001, probe_interval=0.05),
    )
    await dispatcher.setup()
    dispatcher.loop.bind(LeaderTerm(epoch=1, node_id="test-1"))
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(3):  # several passes, several held samples
                await dispatcher.run_once()
        assert await statuses(pool) == {declared: "dispatched", undeclared: "pending"}
        assert await broker_has_queue(settings.amqp_url, declared)
        assert not await broker_has_queue(settings.amqp_url, undeclared)  # never created
        assert held_gauge() == 1
        [logged] = events(caplog, "queue_undeclared")  # once per name, not per pass
        assert logged["queue"] == undeclared and logged["held"] == 1

        assert await QueueStore(pool).add(undeclared)
        await dispatcher.run_once()
        assert await statuses(pool) == {declared: "dispatched", undeclared: "dispatched"}
        assert await broker_has_queue(settings.amqp_url, undeclared)
        assert held_gauge() == 0
    finally:
        await dispatcher.teardown()


async def test_a_paused_queue_dispatches_nothing_new_until_resumed(
    pool: asyncpg.Pool,
    migrated_dsn: str,
    settings: Settings,
    names: tuple[str, str],
) -> None:
    """Pause is a row of the database: every leader's claim skips the queue (here a
    dispatcher's passes; a new leader reads the same row), its due jobs stay pending,
    and resume sends them out. The leader's gauge duetime_queue_paused says which."""
    declared, other = names
    settings = dataclasses.replace(settings, database_url=migrated_dsn)
    await declare_queues(pool, declared, other)
    store = QueueStore(pool)
    assert await store.set_paused(declared, True)
    assert not await store.set_paused("never-declared", True)
    await insert_job(pool, declared)
    await insert_job(pool, other)
    dispatcher = Dispatcher(
        DutyContext.standalone(settings, pool),
        config=DispatcherConfig(backlog_interval=0.001, probe_interval=0.05),
    )
    await dispatcher.setup()
    dispatcher.loop.bind(LeaderTerm(epoch=1, node_id="test-1"))
    try:
        for _ in range(3):
            await dispatcher.run_once()
        assert await statuses(pool) == {declared: "pending", other: "dispatched"}
        assert [q.paused for q in await store.list() if q.name == declared] == [True]
        assert (paused_gauge(declared), paused_gauge(other)) == (1, 0)
        assert await store.set_paused(declared, False)
        await dispatcher.run_once()
        assert await statuses(pool) == {declared: "dispatched", other: "dispatched"}
        assert (paused_gauge(declared), paused_gauge(other)) == (0, 0)
        await store.remove(other)
        await dispatcher.run_once()
        assert paused_gauge(other) is None  # an undeclared queue has no series
    finally:
        await dispatcher.teardown()


async def test_cli_add_releases_held_jobs_within_seconds_without_a_restart(
    pool: asyncpg.Pool,
    migrated_dsn: str,
    settings: Settings,
    test_env: dict[str, str],
    names: tuple[str, str],
) -> None:
    _, undeclared = names
    settings = dataclasses.replace(settings, database_url=migrated_dsn)
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn}
    job_id = await insert_job(pool, undeclared)
    dispatcher = Dispatcher(DutyContext.standalone(settings, pool))
    dispatcher.loop.start(LeaderTerm(epoch=1, node_id="test-1"))
    try:
        await asyncio.sleep(1.0)  # the running dispatcher leaves it alone
        assert await statuses(pool) == {undeclared: "pending"}
        assert not await broker_has_queue(settings.amqp_url, undeclared)

        listed = await run_duetime(env, "queues", "list")
        assert listed.code == 0, listed.err
        [row] = [line.split() for line in listed.out.splitlines() if undeclared in line]
        assert row[:6] == [undeclared, "NO:", "jobs", "held", "-", "1"]  # paused -, pending 1
        assert row[6:8] == ["0", "1"]  # dispatched 0, held 1

        added = await run_duetime(env, "queues", "add", undeclared)
        assert added.code == 0, added.err
        assert added.out.strip() == f"queue {undeclared} declared"

        async def dispatched() -> bool:
            return await statuses(pool) == {undeclared: "dispatched"}

        await wait_for(dispatched, timeout=3, message=f"job {job_id} dispatched after add")
        assert await broker_has_queue(settings.amqp_url, undeclared)
        listed = await run_duetime(env, "queues", "list", "--json")
        data = listed.json()
        assert isinstance(data, list)
        rows = {r["name"]: r for r in data}
        assert rows[undeclared]["declared"] and rows[undeclared]["dispatched"] == 1
        assert rows[undeclared]["held"] == 0 and rows["default"]["declared"]
    finally:
        await dispatcher.loop.stop()


async def test_status_shows_held_jobs_of_an_undeclared_queue(
    pool: asyncpg.Pool, migrated_dsn: str, test_env: dict[str, str], unique: str
) -> None:
    await insert_job(pool, f"undecl-{unique}")
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn}
    run = await run_duetime(env, "status")
    assert f"held: queue undecl-{unique} is not declared" in run.out, run.out
    assert "1 (queue not declared)" in run.out


async def test_status_says_a_queue_is_paused(
    pool: asyncpg.Pool, migrated_dsn: str, test_env: dict[str, str], unique: str
) -> None:
    await declare_queues(pool, f"quiet-{unique}")
    await insert_job(pool, f"quiet-{unique}")
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn}
    assert (await run_duetime(env, "queues", "pause", f"quiet-{unique}")).code == 0
    run = await run_duetime(env, "status")
    assert (
        f"paused: queue quiet-{unique} dispatches nothing new (1 pending, 0 running)" in run.out
    ), run.out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("add", "bad name"), "invalid queue name 'bad name'"),
        (("add", ".dot-first"), "invalid queue name '.dot-first'"),
        (("add", "x" * 101), "invalid queue name"),
        (("remove", "no-such-queue"), "queue no-such-queue is not declared"),
        (("remove", "bad/name"), "invalid queue name 'bad/name'"),
    ],
)
async def test_cli_errors_are_one_line(
    migrated_dsn: str, test_env: dict[str, str], args: tuple[str, ...], message: str
) -> None:
    run = await run_duetime({**test_env, "DUETIME_DATABASE_URL": migrated_dsn}, "queues", *args)
    assert run.code == 2
    assert message in run.error_line()


async def test_cli_add_remove_list(migrated_dsn: str, test_env: dict[str, str]) -> None:
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn}
    assert (await run_duetime(env, "queues", "add", "reports.eu")).out.strip() == (
        "queue reports.eu declared"
    )
    again = await run_duetime(env, "queues", "add", "reports.eu")
    assert again.code == 0 and again.out.strip() == "queue reports.eu already declared"
    listed = (await run_duetime(env, "queues", "list")).out.splitlines()
    assert listed[0].split() == [
        "QUEUE", "DECLARED", "PAUSED", "PENDING", "DISPATCHED", "HELD", "CREATED_AT",
    ]  # fmt: skip
    assert [line.split()[:6] for line in listed[1:]] == [
        ["default", "yes", "no", "0", "0", "0"],
        ["reports.eu", "yes", "no", "0", "0", "0"],
    ]
    paused = await run_duetime(env, "queues", "pause", "reports.eu")
    assert paused.out.strip() == "queue reports.eu paused: nothing new is dispatched"
    listed = (await run_duetime(env, "queues", "list")).out.splitlines()
    assert listed[2].split()[:3] == ["reports.eu", "yes", "PAUSED"]
    resumed = await run_duetime(env, "queues", "resume", "reports.eu")
    assert resumed.out.strip() == "queue reports.eu resumed"
    missing = await run_duetime(env, "queues", "pause", "nowhere")
    assert (missing.code, missing.error_line()) == (2, "queue nowhere is not declared")
    removed = await run_duetime(env, "queues", "remove", "reports.eu")
    assert removed.code == 0 and "queue reports.eu removed: 0 pending jobs now held" in removed.out
    listed = (await run_duetime(env, "queues", "list")).out.splitlines()
    assert [line.split()[0] for line in listed[1:]] == ["default"]


async def test_migration_declares_default_and_the_queues_of_live_jobs_and_schedules(
    fresh_dsn: str,
) -> None:
    """An upgrade keeps working: the queues in use before 0008 are declared by it."""
    conn = await asyncpg.connect(fresh_dsn, timeout=10)
    try:
        await conn.execute(
            "CREATE SCHEMA duetime; CREATE TABLE duetime.schema_migrations ("
            "version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for version, name, sql in migrations():
            if version < 8:
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO duetime.schema_migrations VALUES ($1, $2, $3)",
                    version,
                    name,
                    hashlib.sha256(sql.encode()).hexdigest()[:16],
                )
        await conn.execute(
            "INSERT INTO duetime.jobs (task, queue, status, dispatch_epoch) VALUES "
            "('t', 'live.pending', 'pending', NULL), ('t', 'live.dispatched', 'dispatched', 0), "
            "('t', 'old.done', 'succeeded', 0), ('t', 'old.dead', 'dead', 0)"
        )
        await conn.execute(
            "INSERT INTO duetime.schedules (name, task, cron, queue) "
            "VALUES ('s', 't', '* * * * *', 'from.schedule')"
        )
    finally:
        await conn.close()
    assert "0008_queues" in (await migrate(fresh_dsn)).applied
    conn = await asyncpg.connect(fresh_dsn, timeout=10)
    try:
        declared = {r["name"] for r in await conn.fetch("SELECT name FROM duetime.queues")}
        assert declared == {"default", "live.pending", "live.dispatched", "from.schedule"}
        with pytest.raises(asyncpg.CheckViolationError, match="queues_name_invalid"):
            await conn.execute("INSERT INTO duetime.queues (name) VALUES ('no spaces')")
    finally:
        await conn.close()


async def test_claim_stays_an_ordered_index_scan(pool: asyncpg.Pool) -> None:
    """The declared-queue filter must not turn the claim into a sort of every due row."""

    await pool.execute(
        "INSERT INTO duetime.jobs (task, queue, due_at) "
        "SELECT 't', CASE WHEN i % 10 = 0 THEN 'undecl' || (i % 7) ELSE 'default' END, "
        "now() - make_interval(secs => i) FROM generate_series(1, 20000) i"
    )
    await pool.execute("ANALYZE duetime.jobs")
    async with pool.acquire() as conn, conn.transaction():
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN (COSTS OFF) " + claim_sql(500)))
    assert "Index Scan" in plan and "Sort" not in plan.replace("Sort Key", ""), plan
    assert "Seq Scan on jobs" not in plan, plan


async def test_probe_stays_an_ordered_index_scan(pool: asyncpg.Pool) -> None:
    """The next-run-time probe runs every probe_interval: filtering out held jobs must
    not make it read every pending row (min() with the EXISTS planned a Seq Scan)."""

    await pool.execute(
        "INSERT INTO duetime.jobs (task, queue, due_at) "
        "SELECT 't', CASE WHEN i % 10 = 0 THEN 'undecl' || (i % 7) ELSE 'default' END, "
        "now() - make_interval(secs => i) FROM generate_series(1, 20000) i"
    )
    await pool.execute("ANALYZE duetime.jobs")
    plan = "\n".join(r[0] for r in await pool.fetch("EXPLAIN (COSTS OFF) " + Q["next_run_in"]))
    assert "Index Scan" in plan and "Seq Scan on jobs" not in plan, plan
    assert "Limit" in plan, plan


async def test_worker_warns_at_start_about_an_undeclared_queue(
    procs: Processes, migrated_dsn: str, test_env: dict[str, str], names: tuple[str, str]
) -> None:
    declared, undeclared = names
    await declare_queues(migrated_dsn, declared)
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn}
    argv = duetime_argv(
        "worker", "--import", "tests.fixtures_tasks.basic", "--queue", f"{declared},{undeclared}"
    )
    worker = procs.spawn(argv, name="worker", env=env)
    warning = f"duetime: warning: queue {undeclared} is not declared"
    await wait_for(lambda: warning in worker.output(), timeout=20, message=worker.tail())
    assert f"queue {declared} is not declared" not in worker.output()
    await worker.stop()


async def test_dashboard_overview_says_the_queue_is_not_declared(
    procs: Processes, pool: asyncpg.Pool, migrated_dsn: str, test_env: dict[str, str], unique: str
) -> None:
    import urllib.request

    from tests.dashboard.conftest import free_port

    await insert_job(pool, f"undecl-{unique}")
    port = free_port()
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn}
    served = procs.spawn(
        duetime_argv("dashboard", "--listen", f"127.0.0.1:{port}"), name="dashboard", env=env
    )

    def overview() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
            return str(response.read().decode())

    async def up() -> bool:
        try:
            await asyncio.to_thread(overview)
        except OSError:
            return False
        return True

    await wait_for(up, timeout=20, message=served.tail())
    page = await asyncio.to_thread(overview)
    assert f"held: queue undecl-{unique} is not declared" in page
    await served.stop()


async def test_migrate_declares_the_configured_queues(
    migrated_dsn: str, test_env: dict[str, str]
) -> None:
    env = {**test_env, "DUETIME_DATABASE_URL": migrated_dsn, "DUETIME_QUEUES": "emails,reports.eu"}
    run = await run_duetime(env, "migrate")
    assert run.code == 0, run.err
    assert "queues declared from the configuration: emails, reports.eu (2 new)" in run.out
    conn = await asyncpg.connect(migrated_dsn, timeout=10)
    try:
        names = {r["name"] for r in await conn.fetch("SELECT name FROM duetime.queues")}
    finally:
        await conn.close()
    assert names == {"default", "emails", "reports.eu"}
    bad = await run_duetime({**env, "DUETIME_QUEUES": "a b"}, "migrate")
    assert bad.code == 2 and "'a b' is invalid" in bad.error_line()
