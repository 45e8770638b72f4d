"""The maintainer (scheduler/duties/maintainer.py) against real PostgreSQL.

Each test has a migrated database of its own (``migrated_dsn``): buckets are created
and dropped, which a shared database would see from other tests. "Old" buckets are made
with ``duetime.ensure_partition`` for a day long past; a claim is the dispatcher's own
claim statement in a fenced transaction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import date
from typing import Any

import asyncpg
import pytest

from scheduler import db
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.knobs import config_from_settings
from scheduler.duties.maintainer import Maintainer, MaintainerConfig
from scheduler.errors import Fenced, LeadershipLost
from scheduler.store.dispatch import DispatchStore
from scheduler.store.fence import FenceStore
from scheduler.store.fenced import fenced_transaction
from tests.support.wait import wait_for

EPOCH = 3


@dataclass
class Env:
    settings: Settings
    pool: asyncpg.Pool
    dsn: str
    today: date


@pytest.fixture
async def env(migrated_dsn: str, settings: Settings) -> AsyncIterator[Env]:
    pool = await db.create_pool(migrated_dsn, max_size=4)
    try:
        assert await FenceStore(pool).advance(EPOCH, "test-node")
        today = await pool.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        yield Env(
            dataclasses.replace(settings, database_url=migrated_dsn), pool, migrated_dsn, today
        )
    finally:
        await pool.close()


def make_maintainer(env: Env, *, epoch: int = EPOCH, **config: Any) -> Maintainer:
    values: dict[str, Any] = {"days_ahead": 3, "retention_days": 7.0}
    values.update(config)
    config_ = config_from_settings(MaintainerConfig, env.settings, **values)
    maintainer = Maintainer(DutyContext.standalone(env.settings, env.pool), config=config_)
    maintainer.loop.bind(LeaderTerm(epoch=epoch, node_id="test-node"))
    return maintainer


def part(day: date) -> str:
    return f"jobs_p{day:%Y%m%d}"


async def buckets(pool: asyncpg.Pool) -> set[str]:
    rows = await pool.fetch(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'duetime.jobs'::regclass"
    )
    return {r["relname"] for r in rows}


async def old_bucket(pool: asyncpg.Pool, day: date, statuses: list[str]) -> None:
    """A bucket for ``day`` holding one job per status (due at noon that day)."""
    await pool.execute("SELECT duetime.ensure_partition($1::date)", day)
    await pool.execute(
        "INSERT INTO duetime.jobs (task, due_at, status, finished_at) "
        "SELECT 'old.task', ($1::date + time '12:00') AT TIME ZONE 'UTC', s, "
        "       CASE WHEN s IN ('succeeded', 'dead', 'cancelled') THEN now() END "
        "  FROM unnest($2::text[]) AS s",
        day,
        statuses,
    )


async def claim_ids(pool: asyncpg.Pool, *, epoch: int = EPOCH) -> list[int]:
    store = DispatchStore(pool)
    async with pool.acquire() as conn, fenced_transaction(conn, epoch):
        return [job.id for job in await store.claim(conn, 100)]


async def test_creates_buckets_ahead_idempotently(env: Env) -> None:
    maintainer = make_maintainer(env, days_ahead=20)  # the migration made today-1 .. today+14
    before = await buckets(env.pool)
    delay = await maintainer.run_once()
    report = maintainer.last_report
    assert report is not None
    expected = [date.fromordinal(env.today.toordinal() + i) for i in range(15, 21)]
    assert report.created == expected
    assert await buckets(env.pool) == before | {part(d) for d in expected}
    assert delay == maintainer.config.interval

    await maintainer.run_once()
    assert maintainer.last_report is not None
    assert maintainer.last_report.created == []
    assert maintainer.last_report.deferred == 0


async def test_rows_in_default_move_into_the_new_bucket_and_stay_claimable(env: Env) -> None:
    # today's bucket is missing: jobs due today land in DEFAULT
    await env.pool.execute(f"DROP TABLE duetime.{part(env.today)}")
    ids = [
        r["id"]
        for r in await env.pool.fetch(
            "INSERT INTO duetime.jobs (task, due_at) "
            "SELECT 'moved.task', greatest(now() - interval '1 second', "
            "       (now() AT TIME ZONE 'UTC')::date::timestamp AT TIME ZONE 'UTC') "
            "  FROM generate_series(1, 3) RETURNING id"
        )
    ]
    where = await env.pool.fetch(
        "SELECT tableoid::regclass::text AS t FROM duetime.jobs WHERE id = ANY($1)", ids
    )
    assert {r["t"] for r in where} == {"duetime.jobs_default"}

    maintainer = make_maintainer(env)
    await maintainer.run_once()
    assert maintainer.last_report is not None
    assert env.today in maintainer.last_report.created
    where = await env.pool.fetch(
        "SELECT tableoid::regclass::text AS t, status FROM duetime.jobs WHERE id = ANY($1)", ids
    )
    assert {(r["t"], r["status"]) for r in where} == {(f"duetime.{part(env.today)}", "pending")}
    assert sorted(await claim_ids(env.pool)) == sorted(ids)


async def test_drops_a_terminal_old_bucket_and_keeps_one_with_a_live_row(env: Env) -> None:
    t = env.today.toordinal()
    done_day, live_day, recent_day = (date.fromordinal(t - n) for n in (30, 29, 3))
    await old_bucket(env.pool, done_day, ["succeeded", "dead", "cancelled"])
    await old_bucket(env.pool, live_day, ["succeeded", "pending"])
    await old_bucket(env.pool, recent_day, ["succeeded"])  # inside the retention

    maintainer = make_maintainer(env)
    await maintainer.run_once()
    report = maintainer.last_report
    assert report is not None
    assert report.dropped == [done_day]
    assert report.kept_live == 1
    names = await buckets(env.pool)
    assert part(done_day) not in names
    assert {part(live_day), part(recent_day)} <= names
    assert (
        await env.pool.fetchval("SELECT to_regclass($1)", f"duetime.{part(done_day)}_detached")
        is None
    )

    # the pending row of the kept bucket is still claimed; once it finished, it goes too
    [(job_id, due_at)] = await env.pool.fetch(
        "SELECT id, due_at FROM duetime.jobs WHERE status = 'pending' AND due_at < now()"
    )
    assert await claim_ids(env.pool) == [job_id]
    await env.pool.execute(
        "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now() "
        "WHERE id = $1 AND due_at = $2",
        job_id,
        due_at,
    )
    await maintainer.run_once()
    assert maintainer.last_report is not None
    assert maintainer.last_report.dropped == [live_day]


async def test_a_row_revived_after_the_unlocked_look_keeps_its_bucket(env: Env) -> None:
    """The detach re-checks under its lock (a `jobs retry` may revive a dead row)."""
    day = date.fromordinal(env.today.toordinal() - 20)
    await old_bucket(env.pool, day, ["dead"])
    maintainer = make_maintainer(env)
    # the unlocked look said "terminal"; the row is revived before the detach runs
    [bucket] = await maintainer.store.expired_buckets(maintainer.config.retention)
    assert not bucket.live
    await env.pool.execute("UPDATE duetime.jobs SET status = 'pending' WHERE task = 'old.task'")
    async with env.pool.acquire() as conn, fenced_transaction(conn, EPOCH):
        assert await maintainer.store.detach_bucket(conn, day) == "live"
    assert part(day) in await buckets(env.pool)


async def test_rows_inserted_into_a_dropped_range_go_to_default_are_claimed_and_kept(
    env: Env,
) -> None:
    day = date.fromordinal(env.today.toordinal() - 30)
    await old_bucket(env.pool, day, ["succeeded"])
    maintainer = make_maintainer(env)
    await maintainer.run_once()
    assert maintainer.last_report is not None
    assert maintainer.last_report.dropped == [day]

    late, done = [
        await env.pool.fetchval(
            "INSERT INTO duetime.jobs (task, due_at, status, finished_at) "
            "VALUES ('late.task', ($1::date + time '08:00') AT TIME ZONE 'UTC', $2, NULL) "
            "RETURNING tableoid::regclass::text || ':' || id",
            day,
            status,
        )
        for status in ("pending", "succeeded")
    ]
    assert late.startswith("duetime.jobs_default:") and done.startswith("duetime.jobs_default:")
    await maintainer.run_once()
    report = maintainer.last_report
    assert report is not None
    assert report.created == [] and report.dropped == []
    assert report.default_pruned == 1  # the terminal one; the pending one stays
    assert await claim_ids(env.pool) == [int(late.split(":")[1])]


async def test_prunes_ledger_and_fire_rows_in_batches(env: Env) -> None:
    await env.pool.execute(
        "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, completed_at) "
        "SELECT 'k' || i, i, 1, 't', now() - CASE WHEN i <= 25 THEN interval '8 days' "
        "                                       ELSE interval '1 day' END "
        "  FROM generate_series(1, 40) AS i"
    )
    sid = await env.pool.fetchval(
        "INSERT INTO duetime.schedules (name, task, cron, next_fire_at, plan_at) "
        "VALUES ('s', 't', '* * * * *', now() + interval '1 minute', 'infinity') RETURNING id"
    )
    await env.pool.execute(
        "INSERT INTO duetime.schedule_fires (schedule_id, fire_time, job_id, due_at) "
        "SELECT $1, now() - make_interval(days => d) + interval '1 hour', d, now() "
        "  FROM generate_series(1, 10) AS d",
        sid,
    )
    maintainer = make_maintainer(env, batch_size=10, max_batches=2)
    delay = await maintainer.run_once()
    report = maintainer.last_report
    assert report is not None
    assert (report.ledger_pruned, report.more) == (20, True)  # stopped at max_batches
    assert report.fires_pruned == 3  # 8, 9 and 10 days old
    assert delay == maintainer.config.resume_interval
    await maintainer.run_once()
    assert maintainer.last_report is not None
    assert maintainer.last_report.ledger_pruned == 5
    assert maintainer.last_report.more is False
    assert await env.pool.fetchval("SELECT count(*) FROM duetime.job_ledger") == 15


async def test_prunes_the_start_log_past_each_rates_window(env: Env) -> None:
    """Migration 0018: a start stays while its rate's window may still count it."""
    await env.pool.execute(
        "INSERT INTO duetime.limits (target, rate_count, rate_period) "
        "VALUES ('task:per_second', 5, 1), ('task:per_hour', 5, 3600)"
    )
    await env.pool.execute(
        "INSERT INTO duetime.limit_starts (target, started_at, starts) VALUES "
        " ('task:per_second', now() - interval '2 seconds', 3),"  # out of its window
        " ('task:per_second', now() + interval '1 minute', 1),"  # still in it
        " ('task:per_hour', now() - interval '30 minutes', 2),"  # still in it
        " ('task:per_hour', now() - interval '2 hours', 2),"  # out
        " ('task:removed', now() - interval '1 second', 1)"  # its rate is gone
    )
    maintainer = make_maintainer(env)
    await maintainer.run_once()
    assert maintainer.last_report is not None
    assert maintainer.last_report.starts_pruned == 3
    left = await env.pool.fetch(
        "SELECT target, starts FROM duetime.limit_starts ORDER BY target, starts"
    )
    assert [(r["target"], r["starts"]) for r in left] == [
        ("task:per_hour", 2), ("task:per_second", 1)
    ]  # fmt: skip


async def test_a_stale_epoch_is_fenced_and_changes_nothing(env: Env) -> None:
    day = date.fromordinal(env.today.toordinal() - 30)
    await old_bucket(env.pool, day, ["succeeded"])
    await env.pool.execute(
        "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, completed_at) "
        "VALUES ('old', 1, 1, 't', now() - interval '30 days')"
    )
    before = await buckets(env.pool)
    stale = make_maintainer(env, epoch=EPOCH - 1, days_ahead=20)
    with pytest.raises(Fenced):
        await stale.run_once()
    assert await buckets(env.pool) == before
    assert await env.pool.fetchval("SELECT count(*) FROM duetime.job_ledger") == 1

    lost = make_maintainer(env, days_ahead=20)
    lost.writes._is_leader = lambda: False
    with pytest.raises(LeadershipLost):
        await lost.run_once()
    assert await buckets(env.pool) == before


async def _waiting_for_lock(pool: asyncpg.Pool, mode: str) -> bool:
    return bool(
        await pool.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted AND mode = $1", mode)
    )


async def test_ddl_gives_up_on_its_lock_instead_of_stalling_claims(env: Env) -> None:
    """A claim transaction in flight (publishing) holds the partitions; the maintainer's
    DETACH queues for ACCESS EXCLUSIVE, and a claim arriving now queues behind it. The
    maintainer gives up after lock_timeout, so that claim waits about that long, not for
    the whole in-flight transaction; the next pass drops the bucket."""
    day = date.fromordinal(env.today.toordinal() - 30)
    await old_bucket(env.pool, day, ["succeeded"])
    await env.pool.execute("INSERT INTO duetime.jobs (task, due_at) VALUES ('due', now())")
    lock_timeout = 0.3
    maintainer = make_maintainer(env, lock_timeout=lock_timeout, ddl_timeout=1.0)

    holder = await db.connect(env.dsn)
    claimer = await db.connect(env.dsn)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.fetch("SELECT id FROM duetime.jobs WHERE status = 'pending' FOR UPDATE")
        pass_task = asyncio.create_task(maintainer.run_once())
        await wait_for(
            lambda: _waiting_for_lock(env.pool, "AccessExclusiveLock"),
            timeout=5,
            message="maintainer waiting for ACCESS EXCLUSIVE",
        )
        started = time.perf_counter()
        async with claimer.transaction():
            await claimer.fetch(
                "SELECT id FROM duetime.jobs WHERE status = 'pending' AND due_at <= now() "
                "FOR UPDATE SKIP LOCKED"
            )
        claim_wait = time.perf_counter() - started
        delay = await asyncio.wait_for(pass_task, 10)
        await tx.rollback()
    finally:
        await holder.close()
        await claimer.close()

    report = maintainer.last_report
    assert report is not None
    assert report.deferred == 1 and report.dropped == []
    assert "LockNotAvailable" in (report.deferred_reason or "")
    assert delay == maintainer.config.retry_interval
    assert claim_wait < lock_timeout + 0.5, f"claim stalled {claim_wait:.3f}s"
    assert part(day) in await buckets(env.pool)

    await maintainer.run_once()
    assert maintainer.last_report is not None
    assert maintainer.last_report.dropped == [day]


async def test_a_detached_leftover_is_dropped_by_the_next_pass(env: Env) -> None:
    day = date.fromordinal(env.today.toordinal() - 30)
    await old_bucket(env.pool, day, ["succeeded"])
    maintainer = make_maintainer(env)
    async with env.pool.acquire() as conn, fenced_transaction(conn, EPOCH):
        assert await maintainer.store.detach_bucket(conn, day) == "detached"  # then "crash"
    assert await maintainer.store.detached_leftovers() == [f"{part(day)}_detached"]
    await maintainer.run_once()
    assert maintainer.last_report is not None
    assert maintainer.last_report.leftovers_dropped == 1
    assert await maintainer.store.detached_leftovers() == []


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="ddl_timeout"):
        MaintainerConfig(lock_timeout=2.0, ddl_timeout=1.0)
    with pytest.raises(ValueError, match="interval"):
        MaintainerConfig(interval=0)
    assert MaintainerConfig(retention_days=2).retention == 2 * 86400
