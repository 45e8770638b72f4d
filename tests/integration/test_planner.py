"""The planner end to end on real PostgreSQL: schedules in, jobs out.

Each test has a database of its own (the planner claims every due schedule it finds)
and drives the planner with ``plan_pass()`` under a ``ManualClock``, so a simulated
week across a DST transition runs in milliseconds and asserts on the exact ``due_at``
of the materialized jobs. The cron math itself is unit-tested in test_cron*.py; here
we test what reaches ``duetime.jobs``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
import pytest

from scheduler import db
from scheduler.clock import SYSTEM_CLOCK, ManualClock
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.planner import Planner, PlannerConfig
from scheduler.errors import Fenced
from scheduler.metrics import SCHEDULE_FIRES, SCHEDULE_MISFIRES
from scheduler.planning import ScheduleSpec, deterministic_jitter, fire_key
from scheduler.store.fence import FenceStore
from scheduler.store.schedules import ScheduleStore
from tests.fixtures_tasks.jobs import FENCE_EPOCH
from tests.support.helpers import prune_fires
from tests.support.wait import wait_for

EPOCH = 5
SEC = timedelta(seconds=1)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


@dataclass
class World:
    settings: Settings
    pool: asyncpg.Pool
    store: ScheduleStore
    node: str

    def planner(self, clock: ManualClock | None = None, **config: Any) -> Planner:
        ctx = DutyContext.standalone(self.settings, self.pool, clock=clock or SYSTEM_CLOCK)
        planner = Planner(ctx, config=PlannerConfig(**config))
        planner.loop.bind(LeaderTerm(EPOCH, self.node))
        return planner

    async def add(self, name: str, **kwargs: Any) -> int:
        schedule = await self.store.add(ScheduleSpec(name=name, task="tick", **kwargs))
        return schedule.id

    async def jobs(self, schedule_id: int) -> list[asyncpg.Record]:
        async with self.pool.acquire() as conn:
            return list(
                await conn.fetch(
                    "SELECT id, due_at, idempotency_key, status, schedule_id, task "
                    "FROM duetime.jobs WHERE schedule_id = $1 ORDER BY due_at, id",
                    schedule_id,
                )
            )

    async def due_times(self, schedule_id: int) -> list[datetime]:
        return [r["due_at"] for r in await self.jobs(schedule_id)]

    async def row(self, schedule_id: int) -> asyncpg.Record:
        async with self.pool.acquire() as conn:
            record = await conn.fetchrow(
                "SELECT * FROM duetime.schedules WHERE id = $1", schedule_id
            )
        assert record is not None
        return record

    async def execute(self, sql: str, *args: Any) -> str:
        async with self.pool.acquire() as conn:
            return str(await conn.execute(sql, *args))


@pytest.fixture
async def world(settings: Settings, migrated_dsn: str, unique: str) -> AsyncIterator[World]:
    pool = await db.create_pool(migrated_dsn, min_size=1, max_size=4)
    try:
        assert await FenceStore(pool).advance(EPOCH, f"test-{unique}")
        yield World(
            dataclasses.replace(settings, database_url=migrated_dsn),
            pool,
            ScheduleStore(pool),
            f"test-{unique}",
        )
    finally:
        await pool.close()


async def simulate(planner: Planner, clock: ManualClock, until: datetime, step: float) -> None:
    """Run the planner every ``step`` seconds of simulated time up to ``until``."""
    while True:
        await planner.plan_pass()
        if clock.now() >= until:
            return
        clock.advance(step)


def local_day(tz: str, year: int, month: int, day: int) -> tuple[datetime, datetime]:
    zone = ZoneInfo(tz)
    start = datetime(year, month, day, tzinfo=zone)
    return start.astimezone(UTC), (start + timedelta(days=1)).astimezone(UTC)


# --- basics -------------------------------------------------------------------------------


async def test_row_inserted_by_sql_with_name_task_cron_is_planned(world: World) -> None:
    await world.execute(
        "INSERT INTO duetime.schedules (name, task, cron) VALUES ('sql', 'report', '0 * * * * *')"
    )
    clock = ManualClock(utc(2026, 12, 1, 9, 0, 55))
    fires_before = SCHEDULE_FIRES.labels("main")._value.get()
    report = await world.planner(clock).plan_pass()
    assert (report.claimed, report.fired, report.missed, report.invalid) == (1, 1, 0, 0)
    assert SCHEDULE_FIRES.labels("main")._value.get() - fires_before == 1
    row = await world.row((await world.store.get("sql")).id)
    jobs = await world.jobs(row["id"])
    assert [(j["due_at"], j["idempotency_key"], j["task"]) for j in jobs] == [
        (utc(2026, 12, 1, 9, 1), f"schedule:{row['id']}:2026-12-01T09:01:00Z", "report")
    ]
    assert row["next_fire_at"] == utc(2026, 12, 1, 9, 2)
    assert row["plan_at"] == utc(2026, 12, 1, 9, 1, 55)  # next fire - lead (horizon / 2)
    assert row["last_job_id"] == jobs[0]["id"] and row["fired_count"] == 1
    async with world.pool.acquire() as conn:
        fires = await conn.fetch("SELECT * FROM duetime.schedule_fires")
    assert [(f["schedule_id"], f["fire_time"], f["job_id"]) for f in fires] == [
        (row["id"], utc(2026, 12, 1, 9, 1), jobs[0]["id"])
    ]
    # nothing more to do until plan_at; a second pass claims nothing
    assert (await world.planner(clock).plan_pass()).claimed == 0


async def test_stale_epoch_is_fenced_and_writes_nothing(world: World) -> None:
    sid = await world.add("fenced", cron="* * * * * *")
    planner = Planner(
        DutyContext.standalone(world.settings, world.pool, clock=ManualClock(utc(2026, 12, 1)))
    )
    planner.loop.bind(LeaderTerm(EPOCH - 1, "zombie"))
    with pytest.raises(Fenced):
        await planner.plan_pass()
    assert await world.jobs(sid) == []


async def test_fire_time_is_never_materialized_twice(world: World) -> None:
    """A second leader replanning the same fire times (its view of next_fire_at is
    older, e.g. edited back by hand) creates no second job: schedule_fires dedupes."""
    sid = await world.add("dedupe", cron="* * * * * *")
    clock = ManualClock(utc(2026, 12, 1, 10, 0, 0))
    await world.planner(clock).plan_pass()
    first = await world.jobs(sid)
    assert len(first) == 11
    await world.execute(
        "UPDATE duetime.schedules SET next_fire_at = $2 WHERE id = $1", sid, clock.now()
    )
    await FenceStore(world.pool).advance(EPOCH + 1, "new-leader")
    newer = Planner(
        DutyContext.standalone(world.settings, world.pool, clock=clock), config=PlannerConfig()
    )
    newer.loop.bind(LeaderTerm(EPOCH + 1, "new-leader"))
    report = await newer.plan_pass()
    assert report.duplicates == 11 and report.fired == 0
    assert [j["id"] for j in await world.jobs(sid)] == [j["id"] for j in first]
    with pytest.raises(Fenced):  # and the old leader can no longer write at all
        await world.planner(clock).plan_pass()


# --- DST, end to end (DESIGN §5b) -------------------------------------------------------------

# Fixed-hour expressions: a nonexistent time fires at the first instant after the gap,
# a repeated one once at its first occurrence. Expected values are UTC, from zoneinfo.
FIXED_HOUR_CASES = [
    pytest.param(
        "30 2 * * *", "Europe/Berlin", utc(2026, 3, 27), utc(2026, 3, 31),
        [utc(2026, 3, 27, 1, 30), utc(2026, 3, 28, 1, 30), utc(2026, 3, 29, 1, 0),
         utc(2026, 3, 30, 0, 30)],
        id="berlin-spring-0230-fires-0300-cest",
    ),
    pytest.param(
        "30 2 * * *", "Europe/Berlin", utc(2026, 10, 23, 12), utc(2026, 10, 27),
        [utc(2026, 10, 24, 0, 30), utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)],
        id="berlin-fall-0230-fires-once",
    ),
    pytest.param(
        "30 2 * * *", "America/New_York", utc(2026, 3, 6, 12), utc(2026, 3, 10),
        [utc(2026, 3, 7, 7, 30), utc(2026, 3, 8, 7, 0), utc(2026, 3, 9, 6, 30)],
        id="new-york-spring-0230-fires-0300-edt",
    ),
    pytest.param(
        "30 2 * * *", "America/New_York", utc(2026, 10, 30, 12), utc(2026, 11, 3),
        [utc(2026, 10, 31, 6, 30), utc(2026, 11, 1, 7, 30), utc(2026, 11, 2, 7, 30)],
        id="new-york-fall-0230-fires-once",
    ),
    pytest.param(
        "30 1 * * *", "America/New_York", utc(2026, 10, 31, 12), utc(2026, 11, 2, 12),
        [utc(2026, 11, 1, 5, 30), utc(2026, 11, 2, 6, 30)],
        id="new-york-fall-0130-repeated-fires-first-occurrence-only",
    ),
    pytest.param(
        "45 1 * * *", "Australia/Lord_Howe", utc(2026, 4, 3, 12), utc(2026, 4, 6, 12),
        [utc(2026, 4, 3, 14, 45), utc(2026, 4, 4, 14, 45), utc(2026, 4, 5, 15, 15)],
        id="lord-howe-fall-30min-repeat-fires-once",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("expr", "tz", "start", "end", "expected"), FIXED_HOUR_CASES)
async def test_fixed_hour_schedules_across_dst(
    world: World, expr: str, tz: str, start: datetime, end: datetime, expected: list[datetime]
) -> None:
    sid = await world.add("dst", cron=expr, timezone=tz)
    clock = ManualClock(start)
    planner = world.planner(clock, horizon=6 * 3600, misfire_grace=0)
    await simulate(planner, clock, end, step=3 * 3600)
    due = [t for t in await world.due_times(sid) if t <= end]
    assert due == expected
    row = await world.row(sid)
    assert row["missed_count"] == 0 and row["skipped_count"] == 0


@pytest.mark.parametrize(
    ("tz", "day", "fires"),
    [
        ("Europe/Berlin", (2026, 3, 29), 23),
        ("Europe/Berlin", (2026, 10, 25), 25),
        ("America/New_York", (2026, 3, 8), 23),
        ("America/New_York", (2026, 11, 1), 25),
    ],
)
async def test_hour_wildcard_fires_on_every_real_hour(
    world: World, tz: str, day: tuple[int, int, int], fires: int
) -> None:
    sid = await world.add("hourly", cron="0 * * * *", timezone=tz)
    start, end = local_day(tz, *day)
    clock = ManualClock(start)
    planner = world.planner(clock, horizon=4 * 3600, misfire_grace=0)
    await simulate(planner, clock, end, step=2 * 3600)
    due = [t for t in await world.due_times(sid) if start <= t < end]
    assert len(due) == fires
    assert all(b - a == timedelta(hours=1) for a, b in itertools.pairwise(due))


async def test_lord_howe_half_hour_gap(world: World) -> None:
    """Spring forward by 30 minutes at 02:00: ``0 * * * *`` fires 01:00 then 03:00
    (1.5 real hours apart); ``30 2 * * *`` fires at 02:30 LHDT, the transition itself."""
    hourly = await world.add("lh-hourly", cron="0 * * * *", timezone="Australia/Lord_Howe")
    fixed = await world.add("lh-0230", cron="30 2 * * *", timezone="Australia/Lord_Howe")
    clock = ManualClock(utc(2026, 10, 3, 13))
    planner = world.planner(clock, horizon=3600, misfire_grace=0)
    await simulate(planner, clock, utc(2026, 10, 3, 17), step=1800)
    hours = [t for t in await world.due_times(hourly) if t <= utc(2026, 10, 3, 17)]
    assert hours == [
        utc(2026, 10, 3, 13, 30),  # 00:00 LHST
        utc(2026, 10, 3, 14, 30),  # 01:00 LHST
        utc(2026, 10, 3, 16, 0),  # 03:00 LHDT
        utc(2026, 10, 3, 17, 0),
    ]
    assert await world.due_times(fixed) == [utc(2026, 10, 3, 15, 30)]


async def test_seconds_schedule_every_15_real_seconds_across_the_transition(
    world: World,
) -> None:
    sid = await world.add("secs", cron="*/15 * * * * *", timezone="Europe/Berlin")
    start, end = utc(2026, 3, 29, 0, 59, 0), utc(2026, 3, 29, 1, 1, 0)
    clock = ManualClock(start)
    planner = world.planner(clock, horizon=10, misfire_grace=0)
    await simulate(planner, clock, end, step=5)
    due = [t for t in await world.due_times(sid) if t <= end]
    assert due == [start + i * timedelta(seconds=15) for i in range(9)]
    keys = [j["idempotency_key"] for j in await world.jobs(sid)]
    assert len(keys) == len(set(keys))


# --- downtime and misfire policies ----------------------------------------------------------


async def test_downtime_misfire_policies(world: World) -> None:
    """Planned 2 s ahead, then no planner for 10 s beyond that: skip fires none of the
    missed times and counts them, fire_once one catch-up, fire_all each (capped)."""
    ids = {
        "skip": await world.add("skip", cron="* * * * * *", misfire_policy="skip"),
        "once": await world.add("once", cron="* * * * * *", misfire_policy="fire_once"),
        "all5": await world.add(
            "all5", cron="* * * * * *", misfire_policy="fire_all", misfire_cap=5
        ),
        "all": await world.add("all", cron="* * * * * *", misfire_policy="fire_all"),
    }
    t0 = utc(2026, 12, 1, 8, 0, 0)
    clock = ManualClock(t0)
    planner = world.planner(clock, horizon=2, lead=1, misfire_grace=1)
    await planner.plan_pass()  # t0 .. t0+2 planned for each
    metric = {
        p: SCHEDULE_MISFIRES.labels("main", p)._value.get()
        for p in ("skip", "fire_once", "fire_all")
    }
    clock.advance(12)  # down: nothing ran from t0+2 to t0+12
    report = await planner.plan_pass()

    def span(first: int, last: int) -> list[datetime]:
        return [t0 + i * SEC for i in range(first, last + 1)]

    # missed: t0+3 .. t0+10 (earlier than now - grace); on time again from t0+11
    planned, resumed = span(0, 2), span(11, 14)
    expected = {
        "skip": (planned + resumed, 8),
        "once": (planned + span(10, 10) + resumed, 7),
        "all5": (planned + span(6, 10) + resumed, 3),
        "all": (planned + span(3, 10) + resumed, 0),
    }
    for name, sid in ids.items():
        fires, skipped = expected[name]
        assert await world.due_times(sid) == fires, name
        row = await world.row(sid)
        assert (row["missed_count"], row["skipped_count"]) == (8, skipped), name
        assert row["next_fire_at"] == t0 + 15 * SEC
    assert report.missed == 32
    assert dict(report.missed_by_policy) == {"skip": 8, "fire_once": 8, "fire_all": 16}
    assert SCHEDULE_MISFIRES.labels("main", "skip")._value.get() - metric["skip"] == 8
    assert SCHEDULE_MISFIRES.labels("main", "fire_all")._value.get() - metric["fire_all"] == 16


async def test_long_outage_is_caught_up_in_bounded_passes(world: World) -> None:
    """Two hours of a per-second schedule missed under fire_all (cap 10): 7,200 missed
    fire times are counted exactly, the 10 most recent fire, in bounded batches."""
    sid = await world.add("long", cron="* * * * * *", misfire_policy="fire_all", misfire_cap=10)
    t0 = utc(2026, 12, 1, 8, 0, 0)
    clock = ManualClock(t0)
    planner = world.planner(clock, horizon=2, misfire_grace=0)
    await planner.plan_pass()
    clock.advance(7203)
    report = await planner.plan_pass()
    assert report.batches > 1
    row = await world.row(sid)
    assert row["missed_count"] == 7200 and row["skipped_count"] == 7190
    due = await world.due_times(sid)
    assert due[3:13] == [t0 + i * SEC for i in range(7193, 7203)]
    assert due[-1] == t0 + 7205 * SEC


# --- overlap ---------------------------------------------------------------------------------


async def test_overlap_skip_while_previous_run_unfinished(world: World) -> None:
    """A slow handler: the previous job stays dispatched, so fire times are skipped (and
    counted) until it finishes; planning is just in time, not ahead."""
    sid = await world.add("slow", cron="* * * * * *", overlap_policy="skip")
    t0 = utc(2026, 12, 1, 8, 0, 0)
    clock = ManualClock(t0)
    planner = world.planner(clock)
    await planner.plan_pass()
    jobs = await world.jobs(sid)
    assert [j["due_at"] for j in jobs] == [t0]  # just in time: nothing planned ahead
    await world.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        f"dispatch_epoch = {FENCE_EPOCH} WHERE id = $1",
        jobs[0]["id"],
    )
    for _ in range(3):
        clock.advance(1)
        await planner.plan_pass()
    assert len(await world.jobs(sid)) == 1
    assert (await world.row(sid))["skipped_count"] == 3
    await world.execute(
        "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now() WHERE id = $1",
        jobs[0]["id"],
    )
    clock.advance(1)
    await planner.plan_pass()
    assert await world.due_times(sid) == [t0, t0 + 4 * SEC]


async def test_overlap_buffer_one_runs_one_waiting_fire_after_the_slow_one(world: World) -> None:
    sid = await world.add("buffered", cron="* * * * * *", overlap_policy="buffer_one")
    t0 = utc(2026, 12, 1, 8, 0, 0)
    clock = ManualClock(t0)
    planner = world.planner(clock)
    await planner.plan_pass()
    first = (await world.jobs(sid))[0]
    await world.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        f"dispatch_epoch = {FENCE_EPOCH} WHERE id = $1",
        first["id"],
    )
    for _ in range(3):  # t0+1 waits, t0+2 and t0+3 are skipped
        clock.advance(1)
        await planner.plan_pass()
    row = await world.row(sid)
    assert row["buffered_fire_at"] == t0 + SEC and row["skipped_count"] == 2
    await world.execute(
        "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now() WHERE id = $1",
        first["id"],
    )
    clock.advance(1)  # the waiting fire is checked every buffer_poll (1 s)
    await planner.plan_pass()
    jobs = await world.jobs(sid)
    # the buffered t0+1 runs now (due in the past: at once); t0+4 waits behind it
    assert [j["idempotency_key"] for j in jobs] == [fire_key(sid, t0), fire_key(sid, t0 + SEC)]
    row = await world.row(sid)
    assert row["buffered_fire_at"] == t0 + 4 * SEC and row["skipped_count"] == 2


# --- jitter ---------------------------------------------------------------------------------


async def test_jitter_spreads_a_minute_boundary_herd_deterministically(world: World) -> None:
    await world.execute(
        "INSERT INTO duetime.schedules (name, task, cron, jitter) "
        "SELECT 'herd-' || i, 'tick', '0 * * * * *', 30 FROM generate_series(1, 1000) AS i"
    )
    clock = ManualClock(utc(2026, 12, 1, 8, 0, 55))
    planner = world.planner(clock, batch_size=300)
    report = await planner.plan_pass()
    assert report.fired == 1000 and report.batches == 4

    async def snapshot() -> dict[tuple[int, str], datetime]:
        async with world.pool.acquire() as conn:
            rows = await conn.fetch("SELECT schedule_id, idempotency_key, due_at FROM duetime.jobs")
        return {(r["schedule_id"], r["idempotency_key"]): r["due_at"] for r in rows}

    first = await snapshot()
    fire = utc(2026, 12, 1, 8, 1, 0)
    offsets = [(due - fire).total_seconds() for due in first.values()]
    assert all(0 <= o < 30 for o in offsets)
    for (sid, _), due in list(first.items())[:50]:
        assert due - fire == deterministic_jitter(str(sid), fire, 30)
    buckets = Counter(int(o // 3) for o in offsets)  # ten 3-second buckets, ~100 each
    assert sorted(buckets) == list(range(10))
    assert all(55 <= n <= 145 for n in buckets.values()), buckets
    assert len({round(o, 3) for o in offsets}) > 950  # not a few clumps

    # replay: forget everything and plan the same fire time again -> the same due_at
    await world.execute("DELETE FROM duetime.jobs")
    await world.execute("DELETE FROM duetime.schedule_fires")
    await world.execute("UPDATE duetime.schedules SET next_fire_at = NULL")
    await planner.plan_pass()
    assert await snapshot() == first


# --- bad rows never stop the planner ----------------------------------------------------------


async def test_invalid_rows_are_paused_with_last_error_and_the_rest_planned(
    world: World,
) -> None:
    await world.execute(
        "INSERT INTO duetime.schedules (name, task, cron, timezone) VALUES "
        "('bad-cron', 'tick', '61 * * * *', 'UTC'), "
        "('bad-zone', 'tick', '* * * * *', 'Mars/Olympus'), "
        "('good', 'tick', '* * * * * *', 'UTC')"
    )
    # a row whose jobs the database refuses (here: a trigger) is isolated the same way
    await world.execute(
        """
        CREATE FUNCTION public.refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.task = 'poison' THEN
                RAISE check_violation USING MESSAGE = 'poison is not allowed';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_poison BEFORE INSERT ON duetime.jobs
            FOR EACH ROW EXECUTE FUNCTION public.refuse_poison();
        INSERT INTO duetime.schedules (name, task, cron) VALUES ('poison', 'poison', '* * * * * *');
        """
    )
    clock = ManualClock(utc(2026, 12, 1, 8, 0, 0))
    planner = world.planner(clock)
    report = await planner.plan_pass()
    assert report.invalid == 3 and planner.invalid_total == 3
    rows = {s.name: s for s in await world.store.list()}
    assert rows["bad-cron"].paused and "out of range 0-59" in (rows["bad-cron"].last_error or "")
    assert rows["bad-zone"].paused and "unknown time zone" in (rows["bad-zone"].last_error or "")
    assert rows["poison"].paused and "poison is not allowed" in (rows["poison"].last_error or "")
    assert not rows["good"].paused and rows["good"].fired_count == 11
    assert len(await world.jobs(rows["good"].id)) == 11
    # fixing a row by SQL (and un-pausing it) plans it again from now
    await world.execute(
        "UPDATE duetime.schedules SET cron = '* * * * * *', paused = false WHERE name = 'bad-cron'"
    )
    clock.advance(1)
    await planner.plan_pass()
    fixed = await world.store.get("bad-cron")
    assert not fixed.paused and fixed.last_error is None and fixed.fired_count == 11


# --- pause, resume, remove, trigger ------------------------------------------------------------


async def test_pause_cancels_planned_jobs_and_resume_plans_from_now(world: World) -> None:
    clock = ManualClock(datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=5))
    sid = await world.add("p", cron="* * * * * *")
    planner = world.planner(clock)
    await planner.plan_pass()
    assert len(await world.jobs(sid)) == 11  # all in the (real) future
    schedule, cancelled = await world.store.pause("p")
    assert schedule.paused and cancelled == 11
    assert {j["status"] for j in await world.jobs(sid)} == {"cancelled"}
    clock.advance(3)
    assert (await planner.plan_pass()).claimed == 0
    resumed = await world.store.resume(str(sid))
    assert not resumed.paused and resumed.next_fire_at is None
    await planner.plan_pass()
    pending = [j for j in await world.jobs(sid) if j["status"] == "pending"]
    assert [j["due_at"] for j in pending] == [clock.now() + i * SEC for i in range(11)]
    job = await world.store.trigger("p")
    assert job.schedule_id == sid and job.idempotency_key.startswith(f"schedule:{sid}:trigger:")
    removed, cancelled = await world.store.remove("p")
    assert removed.id == sid and cancelled == 11
    async with world.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM duetime.schedule_fires") == 0


async def test_pausing_or_deleting_by_plain_sql_cancels_planned_jobs(world: World) -> None:
    """The table is the contract: `UPDATE ... SET paused = true` and `DELETE` behave as
    `duetime schedules pause` / `remove` (trigger schedules_paused_cancel_planned and
    schedules_delete_cancel_planned); before migration 0006 the planned jobs ran."""
    clock = ManualClock(datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=5))
    paused = await world.add("sql-paused", cron="* * * * * *")
    deleted = await world.add("sql-deleted", cron="* * * * * *")
    kept = await world.add("sql-kept", cron="* * * * * *")
    planner = world.planner(clock)
    await planner.plan_pass()
    assert [len(await world.jobs(s)) for s in (paused, deleted, kept)] == [11, 11, 11]
    assert (
        await world.execute("UPDATE duetime.schedules SET paused = true WHERE name = 'sql-paused'")
        == "UPDATE 1"
    )
    assert await world.execute("DELETE FROM duetime.schedules WHERE name = 'sql-deleted'") == (
        "DELETE 1"
    )
    assert {j["status"] for j in await world.jobs(paused)} == {"cancelled"}
    assert {j["status"] for j in await world.jobs(deleted)} == {"cancelled"}
    assert {j["status"] for j in await world.jobs(kept)} == {"pending"}
    # fire times forgotten, so a resume plans them again; an update that leaves a paused
    # schedule paused cancels nothing more
    async with world.pool.acquire() as conn:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM duetime.schedule_fires WHERE schedule_id <> $1", kept
            )
            == 0
        )
    assert (
        await world.execute("UPDATE duetime.schedules SET paused = false WHERE name = 'sql-paused'")
        == "UPDATE 1"
    )
    await planner.plan_pass()
    pending = [j for j in await world.jobs(paused) if j["status"] == "pending"]
    assert len(pending) == 11


async def test_bulk_pause_cancels_planned_jobs_in_one_trigger_call(world: World) -> None:
    """Security issue: pausing 10,000 schedules with one UPDATE took minutes, the
    cancel trigger running once per row. Since migration 0011 it runs once per statement
    (counted in pg_stat_xact_user_functions: 1 call, not N), a bulk pause of N planned
    schedules takes well under the bound below, and only the schedules it newly paused
    lose their planned jobs; resumed, they are planned again; a bulk DELETE likewise."""
    n = 2000
    clock = ManualClock(datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=5))
    await world.execute(
        "INSERT INTO duetime.schedules (name, task, cron) "
        "SELECT 'bulk-' || i, 'tick', '* * * * * *' FROM generate_series(1, $1) AS i",
        n,
    )
    already = await world.add("bulk-already", cron="* * * * * *", paused=True)
    other = await world.add("other", cron="* * * * * *")
    planner = world.planner(clock, batch_size=1000)
    await planner.plan_pass()
    async with world.pool.acquire() as conn:
        planned = await conn.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE status = 'pending'"
            " AND schedule_id IN (SELECT id FROM duetime.schedules WHERE name LIKE 'bulk-%')"
        )
        assert planned == n * 11
        async with conn.transaction():
            await conn.execute("SET LOCAL track_functions = 'pl'")
            loop = asyncio.get_running_loop()
            started = loop.time()
            status = await conn.execute(
                "UPDATE duetime.schedules SET paused = true WHERE name LIKE 'bulk-%'"
            )
            elapsed = loop.time() - started
            calls = await conn.fetchval(
                "SELECT calls FROM pg_stat_xact_user_functions"
                " WHERE schemaname = 'duetime' AND funcname = 'cancel_planned_jobs'"
            )
            cancelled = await conn.fetchval(
                "SELECT current_setting('duetime.planned_jobs_cancelled')::bigint"
            )
        assert status == f"UPDATE {n + 1}"
        assert calls == 1
        assert cancelled == planned
        assert elapsed < 10.0, f"bulk pause of {n} schedules took {elapsed:.2f} s"
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE status = 'pending' AND schedule_id <> $1",
                other,
            )
            == 0
        )
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM duetime.schedule_fires WHERE schedule_id <> $1", other
            )
            == 0
        )
    assert {j["status"] for j in await world.jobs(other)} == {"pending"}
    assert await world.jobs(already) == []
    # paused: planning again creates nothing for them
    await planner.plan_pass()
    async with world.pool.acquire() as conn:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE status = 'pending' AND schedule_id <> $1",
                other,
            )
            == 0
        )
    # resumed in bulk: planned again from now, every one of them
    assert (
        await world.execute(
            "UPDATE duetime.schedules SET paused = false WHERE name LIKE 'bulk-%' AND id <> $1",
            already,
        )
        == f"UPDATE {n}"
    )
    await planner.plan_pass()
    async with world.pool.acquire() as conn:
        assert (
            await conn.fetchval(
                "SELECT count(DISTINCT schedule_id) FROM duetime.jobs WHERE status = 'pending'"
                " AND schedule_id <> $1",
                other,
            )
            == n
        )
        async with conn.transaction():
            await conn.execute("SET LOCAL track_functions = 'pl'")
            assert (
                await conn.execute("DELETE FROM duetime.schedules WHERE name LIKE 'bulk-%'")
                == f"DELETE {n + 1}"
            )
            assert (
                await conn.fetchval(
                    "SELECT calls FROM pg_stat_xact_user_functions"
                    " WHERE schemaname = 'duetime' AND funcname = 'cancel_planned_jobs'"
                )
                == 1
            )
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM duetime.jobs WHERE status = 'pending' AND schedule_id <> $1",
                other,
            )
            == 0
        )
    assert {j["status"] for j in await world.jobs(other)} == {"pending"}


# --- the loop: wake-ups --------------------------------------------------------------------


async def test_notify_wakes_the_loop_and_listener_is_reestablished(world: World) -> None:
    """With a 30 s backstop poll, only the insert trigger's NOTIFY can make the loop
    plan a new schedule within a second; after its LISTEN connection is killed the
    planner reconnects and is woken again."""
    planner = world.planner(poll_interval=30.0, probe_interval=30.0)
    task = planner.loop.start(LeaderTerm(EPOCH, world.node))
    try:
        await wait_for(lambda: planner.listening, timeout=5, message="planner listening")

        async def planned(name: str) -> bool:
            async with world.pool.acquire() as conn:
                return bool(
                    await conn.fetchval(
                        "SELECT fired_count > 0 FROM duetime.schedules WHERE name = $1", name
                    )
                )

        async def add_and_wait(name: str) -> float:
            loop = asyncio.get_running_loop()
            started = loop.time()
            await world.execute(
                "INSERT INTO duetime.schedules (name, task, cron) VALUES ($1, 'tick', "
                "'* * * * * *')",
                name,
            )
            await wait_for(lambda: planned(name), timeout=2, interval=0.01, message=name)
            return loop.time() - started

        assert await add_and_wait("first") < 1.0
        killed = await world.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name LIKE '%planner-listen' AND datname = current_database()"
        )
        assert killed == "SELECT 1"
        await wait_for(lambda: planner.listening, timeout=5, message="listener restored")
        assert await add_and_wait("second") < 1.0
        assert not task.done()
    finally:
        await planner.loop.stop()


# --- bounds, wake-up delay, retention ------------------------------------------------------


async def test_end_at_finishes_and_the_loop_sleeps_until_the_next_plan_at(world: World) -> None:
    t0 = utc(2026, 12, 1, 8, 0, 0)
    ends = await world.add("ends", cron="* * * * * *", end_at=t0 + 3 * SEC)
    daily = await world.add("daily", cron="0 9 * * *")
    clock = ManualClock(t0)
    planner = world.planner(clock, poll_interval=30 * 3600.0)
    try:
        delay = await planner.run_once()  # plans both, then sleeps until daily's plan_at
        assert delay == pytest.approx(3600 - 5)  # 09:00 - lead (5 s) - now (08:00)
        assert await world.due_times(ends) == [t0 + i * SEC for i in range(4)]
        finished = await world.store.get(ends)
        assert finished.finished and finished.next_fire_at is None
        assert (await world.store.get(daily)).next_fire_at == utc(2026, 12, 1, 9)
        clock.advance(3600)
        assert await planner.run_once() == pytest.approx(86400 - 5)
        assert len(await world.due_times(daily)) == 1
    finally:
        await planner.teardown()


async def test_prune_fires_keeps_what_deduplication_still_needs(world: World) -> None:
    sid = await world.add("pruned", cron="* * * * * *")
    clock = ManualClock(utc(2026, 12, 1, 8, 0, 0))
    await world.planner(clock).plan_pass()  # fires 08:00:00 .. 08:00:10 recorded
    assert await prune_fires(world.pool, utc(2026, 12, 1, 8, 0, 5)) == 5
    # a cut-off in the future stops at each schedule's next_fire_at (08:00:11 here)
    await world.execute(
        "INSERT INTO duetime.schedule_fires VALUES ($1, $2, 0, $2)", sid, utc(2026, 12, 1, 9)
    )
    assert await prune_fires(world.pool, utc(2030, 1, 1)) == 6
    await world.execute("DELETE FROM duetime.schedule_fires WHERE job_id = 0")
    async with world.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM duetime.schedule_fires") == 0
    assert len(await world.jobs(sid)) == 11


async def test_batch_work_is_bounded_and_the_rest_waits_for_the_next_batch(world: World) -> None:
    """A batch stops deciding once it produced max_fires_per_batch fire times (or spent
    decide_budget): its transaction stays short; the other claimed schedules are left
    untouched and due, and the same pass plans them in the following batches."""
    ids = [await world.add(f"b{i}", cron="* * * * * *") for i in range(3)]
    clock = ManualClock(utc(2026, 12, 1, 8, 0, 0))
    report = await world.planner(clock, max_fires_per_batch=5).plan_pass()
    assert (report.batches, report.claimed, report.fired) == (3, 3, 33)
    for sid in ids:
        assert len(await world.jobs(sid)) == 11


async def test_dispatcher_is_notified_only_for_jobs_due_within_a_second(world: World) -> None:
    """No insert trigger on duetime.jobs (migration 0004): the planner itself sends a
    NOTIFY duetime_jobs when a batch created jobs due within NOTIFY_HORIZON of its now
    (a first fire, catch-ups, just-in-time overlap schedules), and not for jobs planned
    further ahead, which the dispatcher's probe finds in time."""
    listener = await db.connect(world.settings.database_url)
    got: list[str] = []
    arrived = asyncio.Event()

    def on_notify(*args: Any) -> None:
        got.append(args[3])
        if args[3] == "sentinel":
            arrived.set()

    await listener.add_listener("duetime_jobs", on_notify)

    async def notifications() -> list[str]:
        """Everything sent before a sentinel (delivered in commit order)."""
        arrived.clear()
        await world.execute("SELECT pg_notify('duetime_jobs', 'sentinel')")
        await asyncio.wait_for(arrived.wait(), 5)
        seen = got[:-1]
        got.clear()
        return seen

    try:
        await world.add("notified", cron="* * * * * *")
        clock = ManualClock(utc(2026, 12, 1, 8, 0, 0))
        planner = world.planner(clock)
        await planner.plan_pass()  # the first fire is due now
        assert await notifications() == [""]
        clock.advance(6)
        assert (await planner.plan_pass()).fired == 6  # 08:00:11.. is 5 s ahead
        assert await notifications() == []
        await world.store.trigger("notified")
        assert await notifications() == [""]
    finally:
        await listener.close()
