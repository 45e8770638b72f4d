"""Least-privilege roles (scheduler/sql/roles.sql) proven by connecting as each of them.

Every test has a migrated database of its own with the roles applied under a prefix
unique to the test (roles are cluster-wide), and login users created IN ROLE each group
role with random passwords. The real code paths run as those users — ``JobStore`` as
the producer, the dispatcher and the planner and the maintainer as the scheduler, a
``Worker`` as the worker — and every refusal is PostgreSQL's own "permission denied"
(or, for other producers' rows, row-level security showing nothing).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import aio_pika
import asyncpg
import pytest

from scheduler import db
from scheduler.broker import declare_job_queue
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher
from scheduler.duties.knobs import config_from_settings
from scheduler.duties.maintainer import Maintainer, MaintainerConfig
from scheduler.duties.planner import Planner, PlannerConfig
from scheduler.jobspec import JobSpec
from scheduler.messages import JobMessage
from scheduler.planning import ScheduleSpec
from scheduler.roles import RoleNames, apply_roles, drop_roles_connection
from scheduler.store import DispatchStore, ExecutionStore, JobStore, ScheduleStore
from scheduler.store.fence import FenceStore
from scheduler.store.fenced import fenced_transaction
from scheduler.store.limits import LimitStore
from scheduler.store.maintenance import MaintenanceStore
from scheduler.store.rows import JobRef
from tests.fixtures_tasks.jobs import FENCE_EPOCH
from tests.support.helpers import declare_queues
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker
from workers.executor import Executor, Outcome

pytestmark = pytest.mark.timeout(90)
DENIED = asyncpg.InsufficientPrivilegeError


def _as_user(dsn: str, user: str, password: str) -> str:
    parts = urlsplit(dsn)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user)}:{quote(password)}@{host}:{parts.port or 5432}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


@dataclass
class World:
    names: RoleNames
    owner: asyncpg.Pool
    producer: asyncpg.Pool
    producer2: asyncpg.Pool
    worker: asyncpg.Pool
    scheduler: asyncpg.Pool
    urls: dict[str, str]
    settings: Settings

    def as_role(self, role: str, **overrides: Any) -> Settings:
        return dataclasses.replace(self.settings, database_url=self.urls[role], **overrides)


async def _setup(dsn: str, prefix: str, settings: Settings, **kw: Any) -> AsyncIterator[World]:
    names = await apply_roles(dsn, prefix=prefix, **kw)
    owner = await db.create_pool(dsn, max_size=4)
    logins = {
        "producer": names.producer,
        "producer2": names.producer,
        "worker": names.worker,
        "scheduler": names.scheduler,
    }
    users: list[str] = []
    pools: dict[str, asyncpg.Pool] = {}
    urls: dict[str, str] = {}
    try:
        for login, group in logins.items():
            user, password = f"{prefix}_{login}_login", secrets.token_urlsafe(18)
            await owner.execute(
                f'CREATE ROLE "{user}" LOGIN PASSWORD \'{password}\' IN ROLE "{group}"'
            )
            users.append(user)
            urls[login] = _as_user(dsn, user, password)
            pools[login] = await db.create_pool(urls[login], max_size=6)
        yield World(
            names,
            owner,
            pools["producer"],
            pools["producer2"],
            pools["worker"],
            pools["scheduler"],
            urls,
            dataclasses.replace(settings, database_url=dsn),
        )
    finally:
        for pool in pools.values():
            await pool.close()
        async with owner.acquire() as conn:
            for user in users:
                await conn.execute(f'DROP ROLE IF EXISTS "{user}"')
            await drop_roles_connection(conn, names)
        await owner.close()


@pytest.fixture
async def world(migrated_dsn: str, unique: str, settings: Settings) -> AsyncIterator[World]:
    async for w in _setup(migrated_dsn, f"dt{unique}", settings):
        yield w


async def _dispatched(owner: asyncpg.Pool, task: str, queue: str = "default") -> JobMessage:
    row = await owner.fetchrow(
        "INSERT INTO duetime.jobs (task, payload, queue) VALUES ($1, '{\"a\": 1}', $2) "
        "RETURNING id, due_at",
        task,
        queue,
    )
    epoch = await owner.fetchval(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        f"dispatch_epoch = {FENCE_EPOCH} WHERE id = $1 RETURNING dispatch_epoch",
        row["id"],
    )
    return JobMessage(
        row["id"],
        row["due_at"],
        1,
        epoch,
        task=task,
        payload={"a": 1},
        idempotency_key=f"job:{row['id']}",
    )


# -- producer ------------------------------------------------------------------------


async def test_producer_enqueues_and_reads_only_its_own_rows(world: World) -> None:
    job = await JobStore(world.producer).enqueue("p.task", {"x": 1})
    assert job.status == "pending"
    own = await world.producer.fetchrow(
        "SELECT status, created_by FROM duetime.jobs WHERE id = $1", job.id
    )
    assert own["status"] == "pending"
    assert own["created_by"] == f"{world.names.producer[: -len('_producer')]}_producer_login"
    # plain SQL, the DESIGN §3 contract, works too
    await world.producer.execute("INSERT INTO duetime.jobs (task) VALUES ('p.sql')")
    # another producer sees none of it (row-level security), and the owner sees all
    assert await world.producer2.fetchval("SELECT count(*) FROM duetime.jobs") == 0
    assert await world.producer.fetchval("SELECT count(*) FROM duetime.jobs") == 2
    assert await world.owner.fetchval("SELECT count(*) FROM duetime.jobs") == 2


async def test_producer_is_refused_everything_else(world: World) -> None:
    job = await JobStore(world.producer).enqueue("p.task")
    p = world.producer
    refused = [
        ("UPDATE duetime.jobs SET status = 'succeeded' WHERE id = $1", (job.id,)),
        ("DELETE FROM duetime.jobs WHERE id = $1", (job.id,)),
        ("SELECT * FROM duetime.job_ledger", ()),
        ("SELECT * FROM duetime.leader_fence", ()),
        ("UPDATE duetime.leader_fence SET epoch = 999", ()),
        ("INSERT INTO duetime.jobs (task, status) VALUES ('x', 'dispatched')", ()),
        ("INSERT INTO duetime.jobs (task, created_by) VALUES ('x', 'someone_else')", ()),
        ("INSERT INTO duetime.jobs (task, dispatch_epoch) VALUES ('x', 99)", ()),
        ("INSERT INTO duetime.schedules (name, task, cron) VALUES ('n', 't', '* * * * *')", ()),
        ("SELECT duetime.ensure_partition(current_date + 100)", ()),
        ("SELECT duetime.drop_detached_partition('jobs_p20000091_detached')", ()),
        ("TRUNCATE duetime.jobs", ()),
        ("CREATE TABLE duetime.evil (x int)", ()),
    ]
    for sql, args in refused:
        with pytest.raises(DENIED):
            await p.execute(sql, *args)
    # cannot claim: the dispatcher's claim locks FOR UPDATE, which needs UPDATE
    async with p.acquire() as conn, conn.transaction():
        with pytest.raises(DENIED):
            await DispatchStore(p).claim(conn, 10)
    with pytest.raises(DENIED):
        await JobStore(p).cancel(job.id)
    # a producer cannot claim through the fence either
    with pytest.raises(DENIED):
        await FenceStore(p).advance(10**9, "evil")


async def test_producers_keys_are_their_own(world: World) -> None:
    """Migration 0007 through the real roles: a producer cannot write the system's key
    forms nor set schedule_id, and two producers' equal keys are two ledger keys, which
    the worker role computes (it reads created_by and schedule_id for that)."""
    for key in ("job:1", "schedule:1:2031-01-01T00:00:00Z", "key:5:alice:x"):
        with pytest.raises(asyncpg.CheckViolationError, match="jobs_idempotency_key_reserved"):
            await JobStore(world.producer).enqueue("p.key", idempotency_key=key)
    with pytest.raises(DENIED):
        await world.producer.execute(
            "INSERT INTO duetime.jobs (task, idempotency_key, schedule_id) "
            "VALUES ('p.key', 'schedule:1:x', 1)"
        )
    one = await JobStore(world.producer).enqueue("p.key", idempotency_key="order:1")
    two = await JobStore(world.producer2).enqueue("p.key", idempotency_key="order:1")
    assert one.effective_key != two.effective_key
    assert one.effective_key.endswith(":order:1") and one.created_by
    assert one.effective_key == f"key:{len(one.created_by)}:{one.created_by}:order:1"
    await world.owner.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        f"dispatch_epoch = {FENCE_EPOCH} WHERE id = ANY($1::bigint[])",
        [one.id, two.id],
    )
    refs = [JobRef(job.id, job.due_at, 1) for job in (one, two)]
    locked = await ExecutionStore(world.worker).begin(refs)
    assert [(j.key, j.done) for j in locked if j is not None] == [
        (one.effective_key, False),
        (two.effective_key, False),
    ]


async def test_producer_bulk_copy_is_refused_by_row_level_security(world: World) -> None:
    """Known limitation (docs/security.md): PostgreSQL refuses COPY FROM into a table
    with row-level security for roles subject to it; producers batch with INSERT."""
    with pytest.raises(asyncpg.FeatureNotSupportedError, match="row-level security"):
        await JobStore(world.producer).bulk_enqueue([JobSpec(task="p.bulk")])
    await world.producer.executemany(
        "INSERT INTO duetime.jobs (task, payload) VALUES ($1, $2)",
        [("p.bulk", {"i": i}) for i in range(50)],
    )
    assert await world.producer.fetchval("SELECT count(*) FROM duetime.jobs") == 50


async def test_producer_schedules_only_with_the_flag(
    migrated_dsn: str, unique: str, settings: Settings
) -> None:
    async for w in _setup(migrated_dsn, f"ds{unique}", settings, producer_schedules=True):
        store = ScheduleStore(w.producer)
        schedule = await store.add(ScheduleSpec(name="nightly", task="report", cron="0 3 * * *"))
        assert schedule.name == "nightly"
        assert await w.producer2.fetchval("SELECT count(*) FROM duetime.schedules") == 0
        for sql in (
            "UPDATE duetime.schedules SET paused = true",
            "DELETE FROM duetime.schedules",
            "INSERT INTO duetime.schedules (name, task, cron, next_fire_at) "
            "VALUES ('x', 't', '* * * * *', now())",
        ):
            with pytest.raises(DENIED):
                await w.producer.execute(sql)
        # and the scheduler role plans it
        assert await FenceStore(w.scheduler).advance(1, "n1")
        planner = Planner(
            DutyContext.standalone(w.as_role("scheduler"), w.scheduler), config=PlannerConfig()
        )
        planner.loop.bind(LeaderTerm(1, "n1"))
        await planner.plan_pass()
        row = await w.owner.fetchrow(
            "SELECT next_fire_at, paused, last_error FROM duetime.schedules"
        )
        assert row["next_fire_at"] is not None and not row["paused"], dict(row)
    # re-applied without the flag: the grant is taken away again
    names = await apply_roles(migrated_dsn, prefix=f"ds{unique}")
    conn = await db.connect(migrated_dsn)
    try:
        assert not await conn.fetchval(
            "SELECT has_table_privilege($1, 'duetime.schedules', 'INSERT')", names.producer
        )
        assert await conn.fetchval(
            "SELECT has_table_privilege($1, 'duetime.jobs', 'SELECT')", names.producer
        )
        await drop_roles_connection(conn, names)
    finally:
        await conn.close()


# -- worker --------------------------------------------------------------------------


def _registry(calls: list[int]) -> Registry:
    registry = Registry()

    @registry.task("w.ok")
    async def ok(ctx: JobContext, payload: dict[str, Any]) -> None:
        calls.append(ctx.job_id)

    @registry.task("w.fail", max_attempts=2)
    async def fail(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise RuntimeError("boom")

    return registry


async def test_worker_runs_the_execution_path(world: World) -> None:
    calls: list[int] = []
    store = ExecutionStore(world.worker)
    executor = Executor(world.worker, _registry(calls), worker_name="w1", heartbeat_interval=5)
    ok = await _dispatched(world.owner, "w.ok")
    assert await executor.execute(ok) is Outcome.SUCCEEDED
    assert calls == [ok.job_id]
    assert await executor.execute(ok) is Outcome.SKIPPED  # duplicate delivery
    failing = await _dispatched(world.owner, "w.fail")
    assert await executor.execute(failing) is Outcome.RETRIED
    unknown = await _dispatched(world.owner, "os.system")
    assert await executor.execute(unknown) is Outcome.RETRIED  # a rolling deploy: not dead yet
    beat = await _dispatched(world.owner, "w.ok")
    assert await store.heartbeat(beat.job_id, beat.due_at, 1)
    rows = {
        r["id"]: r
        for r in await world.owner.fetch("SELECT id, status, attempt, last_error FROM duetime.jobs")
    }
    assert rows[ok.job_id]["status"] == "succeeded"
    assert (rows[failing.job_id]["status"], rows[failing.job_id]["attempt"]) == ("pending", 2)
    assert (rows[unknown.job_id]["status"], rows[unknown.job_id]["attempt"]) == ("pending", 2)
    assert await world.owner.fetchval("SELECT count(*) FROM duetime.job_ledger") == 1


async def test_worker_is_refused_everything_else(world: World) -> None:
    job = await _dispatched(world.owner, "w.ok")
    w = world.worker
    for sql in (
        "DELETE FROM duetime.jobs",
        "INSERT INTO duetime.jobs (task) VALUES ('x')",
        "SELECT last_error FROM duetime.jobs",
        "UPDATE duetime.jobs SET payload = '{}'",
        "UPDATE duetime.leader_fence SET epoch = 999",
        "SELECT * FROM duetime.leader_fence",
        "DELETE FROM duetime.job_ledger",
        "SELECT * FROM duetime.schedules",
        "SELECT duetime.ensure_partition(current_date + 100)",
        "TRUNCATE duetime.job_ledger",
    ):
        with pytest.raises(DENIED):
            await w.execute(sql)
    async with w.acquire() as conn, conn.transaction():
        with pytest.raises(DENIED):
            await fenced_transaction(conn, 1).__aenter__()
    assert (
        await world.owner.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job.job_id)
        == "dispatched"
    )


async def _job(owner: asyncpg.Pool, status: str = "pending", due: str = "now()") -> JobRef:
    row = await owner.fetchrow(
        f"INSERT INTO duetime.jobs (task, due_at) VALUES ('w.ok', {due}) RETURNING id, due_at"
    )
    if status != "pending":
        await owner.execute(
            "UPDATE duetime.jobs SET status = $2, dispatched_at = now(), "
            f"dispatch_epoch = {FENCE_EPOCH} WHERE id = $1",
            row["id"],
            status,
        )
    return JobRef(row["id"], row["due_at"], 1)


async def test_worker_settles_only_dispatched_attempts(world: World) -> None:
    """The worker role (and so every handler's ctx.db) cannot rewrite jobs: no table
    privilege on jobs or the ledger, and the settlement functions touch only a row that
    is dispatched at the attempt named, writing the ledger row from that row."""
    pending = await _job(world.owner)
    future = await _job(world.owner, due="now() + interval '1 hour'")
    dispatched = await _job(world.owner, "dispatched")
    other = await _job(world.owner, "dispatched")
    w = world.worker
    for sql in (
        "UPDATE duetime.jobs SET status = 'succeeded' WHERE status = 'pending'",
        "UPDATE duetime.jobs SET status = 'cancelled'",
        "UPDATE duetime.jobs SET run_at = '9999-12-30'",
        "UPDATE duetime.jobs SET heartbeat_at = now()",
        "SELECT id FROM duetime.jobs WHERE status = 'pending' FOR UPDATE",
        "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task) "
        "SELECT 'job:' || g, g, 1, 'x' FROM generate_series(1, 1000) g",
    ):
        with pytest.raises(DENIED):
            await w.execute(sql)
    for ref in (pending, future):
        args = (ref.job_id, ref.due_at, 1)
        assert (
            await w.fetchval(
                "SELECT duetime.worker_complete($1, $2, $3, 'w')", *([a] for a in args)
            )
            == []
        )
        assert (
            await w.fetchval("SELECT duetime.worker_retry($1, $2, $3, 0, 'e', '{}')", *args) is None
        )
        assert await w.fetchval("SELECT duetime.worker_dead($1, $2, $3, 'e', '{}')", *args) is None
        assert await w.fetchval("SELECT duetime.worker_heartbeat($1, $2, $3)", *args) is None
        with pytest.raises(asyncpg.PostgresError) as refused:
            await w.execute("SELECT duetime.finish_attempt($1, $2, $3, 'w')", *args)
        assert refused.value.sqlstate == "DT001"
    # the wrong attempt of a dispatched row is refused as well
    wrong = (dispatched.job_id, dispatched.due_at, 2)
    assert await w.fetchval("SELECT duetime.worker_dead($1, $2, $3, 'e', '{}')", *wrong) is None
    # a retry cannot push run_at further than the bound (366 days)
    run_at = await w.fetchval(
        "SELECT duetime.worker_retry($1, $2, 1, 1e15, 'e', '{}')",
        dispatched.job_id,
        dispatched.due_at,
    )
    assert run_at < datetime.now(UTC) + timedelta(days=367)
    # the ledger row is the settled row's own key, whatever the caller passes around
    assert await w.fetchval(
        "SELECT duetime.worker_complete($1, $2, $3, 'w')",
        [other.job_id],
        [other.due_at],
        [1],
    ) == [other.job_id]
    rows = {
        r["id"]: (r["status"], r["run_at"])
        for r in await world.owner.fetch("SELECT id, status, run_at FROM duetime.jobs")
    }
    assert rows[pending.job_id] == ("pending", None)
    assert rows[future.job_id] == ("pending", None)
    assert rows[dispatched.job_id][0] == "pending"
    assert rows[other.job_id][0] == "succeeded"
    ledger = await world.owner.fetch("SELECT idempotency_key, job_id FROM duetime.job_ledger")
    assert [(r["idempotency_key"], r["job_id"]) for r in ledger] == [
        (f"job:{other.job_id}", other.job_id)
    ]


# -- scheduler -----------------------------------------------------------------------


async def test_scheduler_fences_claims_and_reconciles(world: World) -> None:
    s = world.scheduler
    assert await FenceStore(s).advance(5, "leader")
    await FenceStore(s).heartbeat(5)
    await JobStore(world.producer).enqueue("p.task")
    store = DispatchStore(s)
    async with s.acquire() as conn, fenced_transaction(conn, 5):
        claimed = await store.claim(conn, 10)
        assert len(claimed) == 1
        assert len(await store.mark_dispatched(conn, claimed, 5)) == 1
    await world.owner.execute("UPDATE duetime.jobs SET dispatched_at = now() - interval '1 hour'")
    async with s.acquire() as conn, fenced_transaction(conn, 5):
        stalled = await store.lock_stalled(conn, 60, 10)
        assert [j.job.id for j in stalled] == [claimed[0].id]
        assert await store.mark_redispatched(conn, [j.job for j in stalled], 5)
    assert await store.next_run_in() is None
    assert await store.backlog() == 0


async def test_scheduler_logs_reads_and_prunes_rate_limit_starts(world: World) -> None:
    """Migration 0018: the dispatcher's start log and the maintainer's prune, as the
    scheduler role; the limits themselves stay the owner's."""
    await LimitStore(world.owner).set("task:r.task", None, rate="5/s")
    s = world.scheduler
    assert await FenceStore(s).advance(3, "leader")
    store = LimitStore(s)
    [limit] = await store.all()
    async with s.acquire() as conn, fenced_transaction(conn, 3):
        await store.record_starts(conn, {("task:r.task", ""): 2})
        started = await store.starts(conn, [limit])
    assert [(x.target, x.count) for x in started] == [("task:r.task", 2)]
    await world.owner.execute(
        "UPDATE duetime.limit_starts SET started_at = now() - interval '1 minute'"
    )
    async with s.acquire() as conn, fenced_transaction(conn, 3):
        assert await MaintenanceStore(s).prune_limit_starts(conn, 10) == 1
    with pytest.raises(DENIED):
        await store.set("task:r.task", None, rate="500/s")


async def test_scheduler_maintainer_ddl_goes_through_definer_functions(world: World) -> None:
    assert await FenceStore(world.scheduler).advance(2, "leader")
    old = (datetime.now(UTC) - timedelta(days=40)).date()
    await world.owner.execute("SELECT duetime.ensure_partition($1::date)", old)
    await world.owner.execute(
        "INSERT INTO duetime.jobs (task, due_at, status, finished_at) "
        "VALUES ('old', $1::date + interval '12 hours', 'succeeded', now())",
        old,
    )
    settings = world.as_role("scheduler")
    maintainer = Maintainer(
        DutyContext.standalone(settings, world.scheduler),
        config=config_from_settings(MaintainerConfig, settings, days_ahead=20, retention_days=7.0),
    )
    maintainer.loop.bind(LeaderTerm(epoch=2, node_id="leader"))
    await maintainer.run_once()
    report = maintainer.last_report
    assert report is not None
    names = {
        r["relname"]
        for r in await world.owner.fetch(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'duetime.jobs'::regclass"
        )
    }
    assert f"jobs_p{old:%Y%m%d}" not in names  # retired through the definer functions
    ahead = (datetime.now(UTC) + timedelta(days=19)).date()
    assert f"jobs_p{ahead:%Y%m%d}" in names  # created ahead
    s = world.scheduler
    for sql in (
        "DROP TABLE duetime.jobs_default",
        "DELETE FROM duetime.jobs",
        "TRUNCATE duetime.jobs",
        "CREATE TABLE duetime.evil (x int)",
        "ALTER TABLE duetime.jobs DETACH PARTITION duetime.jobs_default",
        "UPDATE duetime.jobs SET payload = '{}'",
        "INSERT INTO duetime.jobs (task, status) VALUES ('x', 'succeeded')",
        "SELECT duetime.partition_is_live('duetime.job_ledger'::regclass)",
        "INSERT INTO duetime.leader_fence (shard) VALUES (7)",
    ):
        with pytest.raises((DENIED, asyncpg.RaiseError)):
            await s.execute(sql)


async def test_end_to_end_as_least_privilege_roles(world: World, unique: str) -> None:
    """Producer enqueues → dispatcher (scheduler role) publishes → Worker (worker role)."""
    queue = f"roles-{unique}"
    calls: list[int] = []
    connection = await aio_pika.connect(world.settings.amqp_url, timeout=10)
    try:
        channel = await connection.channel()
        await declare_job_queue(channel, queue, delivery_limit=world.settings.delivery_limit)
        await declare_queues(world.owner, queue)
        job = await JobStore(world.producer).enqueue("w.ok", {"n": 1}, queue=queue)
        assert await FenceStore(world.scheduler).advance(9, "leader")
        dispatcher = Dispatcher(DutyContext.standalone(world.as_role("scheduler"), world.scheduler))
        dispatcher.loop.bind(LeaderTerm(epoch=9, node_id="leader"))
        worker = Worker(
            world.as_role("worker"), queues=[queue], registry=_registry(calls), concurrency=2
        )
        await dispatcher.publisher.open()
        try:
            report = await dispatcher.dispatch_batch()
            assert report.published == 1
            async with worker:
                await wait_for(
                    lambda: world.producer.fetchval(
                        "SELECT status = 'succeeded' FROM duetime.jobs WHERE id = $1", job.id
                    ),
                    timeout=15,
                    message="job succeeded (as seen by its producer)",
                )
        finally:
            await dispatcher.publisher.close()
        assert calls == [job.id]
        await channel.queue_delete(f"duetime.{queue}")
    finally:
        await connection.close()


async def test_payload_ceiling_measures_compressed_values_uncompressed(world: World) -> None:
    """A payload that arrives already compressed (lz4, INSERT ... SELECT from a temporary
    table) is measured uncompressed: 20 MB stored as ~80 KB is refused by
    jobs_payload_too_large; 1,000,000 bytes stored the same way still pass."""
    async with world.producer.acquire() as conn:
        await conn.execute("SET default_toast_compression = lz4")
        await conn.execute("CREATE TEMP TABLE big (p jsonb)")
        await conn.execute(
            "INSERT INTO big SELECT jsonb_build_object('x', repeat('a', 20 * 1024 * 1024))"
        )
        assert await conn.fetchval("SELECT pg_column_size(p) FROM big") < 1048576
        with pytest.raises(asyncpg.CheckViolationError) as refused:
            await conn.execute("INSERT INTO duetime.jobs (task, payload) SELECT 'big', p FROM big")
        assert refused.value.constraint_name == "jobs_payload_too_large"
        await conn.execute("TRUNCATE big")
        await conn.execute("INSERT INTO big SELECT jsonb_build_object('x', repeat('a', 1000000))")
        await conn.execute("INSERT INTO duetime.jobs (task, payload) SELECT 'fits', p FROM big")
    # schedules carry the same ceiling (the planner copies their payloads into jobs)
    async with world.owner.acquire() as conn:
        await conn.execute("SET default_toast_compression = lz4")
        await conn.execute("CREATE TEMP TABLE big (p jsonb)")
        await conn.execute(
            "INSERT INTO big SELECT jsonb_build_object('x', repeat('a', 20 * 1024 * 1024))"
        )
        with pytest.raises(asyncpg.CheckViolationError) as refused:
            await conn.execute(
                "INSERT INTO duetime.schedules (name, task, cron, payload) "
                "SELECT 'big', 'big', '* * * * *', p FROM big"
            )
        assert refused.value.constraint_name == "schedules_payload_too_large"
    assert await world.owner.fetchval("SELECT array_agg(task) FROM duetime.jobs") == ["fits"]


async def test_scheduler_maintenance_stays_in_the_maintainers_box(world: World) -> None:
    """The scheduler role creates buckets only from today to today + 100 days, detaches
    only buckets whose range ended, and deletes only terminal rows of DEFAULT past the
    retention."""
    s, owner = world.scheduler, world.owner
    today = datetime.now(UTC).date()
    for sql in (
        f"SELECT duetime.ensure_partitions('{today + timedelta(days=200)}'::date, 3)",
        f"SELECT duetime.ensure_partition('{today + timedelta(days=200)}'::date)",
        "DELETE FROM duetime.jobs_default",
    ):
        with pytest.raises(DENIED):
            await s.execute(sql)
    for day in (today + timedelta(days=101), today - timedelta(days=3)):
        with pytest.raises(asyncpg.InvalidParameterValueError):
            await s.execute("SELECT duetime.create_bucket($1::date)", day)
    assert await s.fetchval("SELECT duetime.create_bucket($1::date)", today + timedelta(days=100))
    # today's bucket holds only terminal rows (none at all): still not detached
    for day in (today, today + timedelta(days=1)):
        with pytest.raises(asyncpg.InvalidParameterValueError):
            await s.execute("SELECT duetime.detach_terminal_partition($1::date)", day)
    # DEFAULT: a pending job due beyond the buckets, an old finished one, a recent one
    far, old, recent = [
        await owner.fetchval(
            "INSERT INTO duetime.jobs (task, due_at, status, finished_at) "
            f"VALUES ('d', {due}, $1, {finished}) RETURNING tableoid::regclass::text",
            status,
        )
        for due, status, finished in (
            ("now() + interval '300 days'", "pending", "NULL"),
            ("now() - interval '40 days'", "succeeded", "now() - interval '39 days'"),
            ("now() - interval '40 days'", "dead", "now()"),
        )
    ]
    assert far == old == recent == "duetime.jobs_default"
    week = 7 * 86400
    assert await s.fetchval("SELECT duetime.prune_default($1, 100000000)", week) == 1  # old
    assert await s.fetchval("SELECT duetime.prune_default(-1e300, 10)") == 1  # recent
    assert await owner.fetchval("SELECT array_agg(status) FROM duetime.jobs_default") == ["pending"]


async def test_scheduler_prunes_the_ledger_only_past_a_day_and_never_a_live_jobs_row(
    world: World,
) -> None:
    """The scheduler role prunes the idempotency ledger only through
    ``duetime.prune_ledger``: a retention under one day is refused (0 emptied the ledger,
    so duplicates of completed keys ran again), and the row of a job still pending or
    dispatched stays until that job is no longer live."""
    s, owner = world.scheduler, world.owner
    for sql in (
        "DELETE FROM duetime.job_ledger",
        "UPDATE duetime.job_ledger SET completed_at = now() - interval '1 year'",
        "SELECT 1 FROM duetime.job_ledger FOR UPDATE",
    ):
        with pytest.raises(DENIED):
            await s.execute(sql)
    ids = {}
    for name, status in (
        ("dispatched", "pending"),
        ("pending", "pending"),
        ("old", "succeeded"),
        ("recent", "succeeded"),
    ):
        ids[name] = await owner.fetchval(
            "INSERT INTO duetime.jobs (task, status) VALUES ('l', $1) RETURNING id", status
        )
    await owner.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        f"dispatch_epoch = {FENCE_EPOCH} WHERE id = $1",
        ids["dispatched"],
    )
    for name, age in (("dispatched", 30), ("pending", 30), ("old", 30), ("recent", 0.5)):
        await owner.execute(
            "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, "
            "completed_at) VALUES ($1, $2, 1, 'l', now() - $3 * interval '1 day')",
            name,
            ids[name],
            age,
        )
    for retention in (0.0, -1e300, 3600.0, 86399.0, float("nan"), None):
        with pytest.raises(asyncpg.InvalidParameterValueError, match="under the floor"):
            await s.fetchval("SELECT duetime.prune_ledger($1, 1000)", retention)
    day = 86400.0
    assert await s.fetchval("SELECT duetime.prune_ledger($1, 1000)", day) == 1  # "old"
    keys = {r["idempotency_key"] for r in await owner.fetch("SELECT * FROM duetime.job_ledger")}
    assert keys == {"dispatched", "pending", "recent"}
    # once the dispatched job has settled, its row is past the retention like any other
    await owner.execute(
        "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now() WHERE id = $1",
        ids["dispatched"],
    )
    assert await s.fetchval("SELECT duetime.prune_ledger($1, 1000)", day) == 1
    keys = {r["idempotency_key"] for r in await owner.fetch("SELECT * FROM duetime.job_ledger")}
    assert keys == {"pending", "recent"}


async def test_scheduler_may_rewrite_dispatch_columns_and_nothing_else_of_a_job(
    world: World,
) -> None:
    """What the scheduler role can still do to a job, and where that stops. It is the
    trusted dispatcher: it may set the dispatch columns of any job (here a pending job is
    cancelled with a made-up error), but a dispatch must carry the fence's epoch, and what
    a job runs, when and how often (task, payload, queue, run_at, attempt, keys, owner) is
    not its to change; it inserts jobs only as pending (the planner's grant), deletes no job
    and writes no ledger row."""
    s, owner = world.scheduler, world.owner
    job = await _job(owner)
    where = f"WHERE id = {job.job_id}"
    await s.execute(
        "UPDATE duetime.jobs SET status = 'cancelled', finished_at = now(), "
        f"last_error = 'cancelled by the scheduler role' {where}"
    )
    row = await owner.fetchrow(f"SELECT status, last_error FROM duetime.jobs {where}")
    assert row is not None and row["status"] == "cancelled"
    epoch = await owner.fetchval("SELECT epoch FROM duetime.leader_fence WHERE shard = 0")
    with pytest.raises(asyncpg.IntegrityConstraintViolationError, match="fence holds epoch"):
        await s.execute(
            "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
            f"dispatch_epoch = {epoch + 7} {where}"
        )
    for assignment in (
        "task = 'other.task'",
        "payload = '{\"x\": 1}'",
        "queue = 'other'",
        "run_at = now() + interval '1 year'",
        "attempt = 99",
        "max_attempts = 1000",
        "idempotency_key = 'k'",
        "created_by = 'someone'",
        "schedule_id = 1",
        "due_at = now() + interval '1 day'",
    ):
        with pytest.raises(DENIED):
            await s.execute(f"UPDATE duetime.jobs SET {assignment} {where}")
    # the planner's grant: it inserts jobs (any registered task, any payload), but not
    # in a state other than pending
    assert await s.fetchval(
        "INSERT INTO duetime.jobs (task, payload) VALUES ('any.task', '{}') RETURNING id"
    )
    for sql in (
        "INSERT INTO duetime.jobs (task, status) VALUES ('any.task', 'succeeded')",
        f"DELETE FROM duetime.jobs {where}",
        "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task) "
        f"VALUES ('job:{job.job_id}', {job.job_id}, 1, 't')",
    ):
        with pytest.raises(DENIED):
            await s.execute(sql)
