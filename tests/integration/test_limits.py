"""Concurrency limits (migration 0016; docs/architecture.md "Limits"), against real
PostgreSQL and RabbitMQ: the one fenced dispatcher keeps a target's dispatched jobs at
or under its limit, so no more than that many handlers ever run at once.

Each test has a database of its own (the dispatcher claims every due job in it) and a
queue named after the test. Concurrency is measured from the handlers' own start and end
records, never from the rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import asyncpg
import pytest
from prometheus_client import REGISTRY

from scheduler import db
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher, DispatcherConfig
from scheduler.duties.knobs import config_from_settings
from scheduler.errors import InvalidInput
from scheduler.status import limits_holding, read_limits
from scheduler.store.fence import FenceStore
from scheduler.store.jobs import JobStore
from scheduler.store.limits import Closed, LimitStore
from tests.fixtures_tasks.jobs import dispatched_job
from tests.support.cli import run_duetime
from tests.support.helpers import declare_queues
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker

pytestmark = pytest.mark.timeout(120)

TASK = "t.limited"


@dataclass
class Env:
    settings: Settings
    pool: asyncpg.Pool
    queue: str
    dsn: str


@dataclass
class Running:
    """What the handlers record: how many run now, overall and per key, and the most."""

    now: int = 0
    peak: int = 0
    per_key: Counter[str] = field(default_factory=Counter)
    peak_per_key: Counter[str] = field(default_factory=Counter)
    started: list[str] = field(default_factory=list)


@pytest.fixture
async def env(migrated_dsn: str, settings: Settings, unique: str) -> AsyncIterator[Env]:
    pool = await db.create_pool(
        migrated_dsn, max_size=8, server_settings={"idle_in_transaction_session_timeout": "10000"}
    )
    try:
        assert await FenceStore(pool).advance(1, "test-node")
        await declare_queues(pool, unique)
        yield Env(
            dataclasses.replace(settings, database_url=migrated_dsn), pool, unique, migrated_dsn
        )
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def dispatching(env: Env, *, epoch: int = 1, **knobs: Any) -> AsyncIterator[Dispatcher]:
    knobs = {"limits_interval": 0.2, "backlog_interval": 0.2, **knobs}
    config = config_from_settings(DispatcherConfig, env.settings, **knobs)
    dispatcher = Dispatcher(DutyContext.standalone(env.settings, env.pool), config=config)
    dispatcher.loop.start(LeaderTerm(epoch=epoch, node_id=f"test-node-{epoch}"))
    try:
        yield dispatcher
    finally:
        await dispatcher.loop.stop()


@contextlib.asynccontextmanager
async def working(env: Env, running: Running, *, concurrency: int) -> AsyncIterator[None]:
    """One worker whose handler counts itself in ``running`` while it sleeps a little."""
    registry = Registry()

    @registry.task(TASK)
    async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
        key = payload.get("key", "")
        running.now += 1
        running.per_key[key] += 1
        running.peak = max(running.peak, running.now)
        running.peak_per_key[key] = max(running.peak_per_key[key], running.per_key[key])
        running.started.append(key)
        try:
            await asyncio.sleep(0.03)
        finally:
            running.now -= 1
            running.per_key[key] -= 1

    worker = Worker(
        env.settings,
        queues=[env.queue],
        registry=registry,
        concurrency=concurrency,
        grace_period=5,
    )
    await worker.start()
    try:
        yield
    finally:
        await worker.stop()


async def insert(pool: asyncpg.Pool, queue: str, n: int, *, key: str | None = None) -> None:
    """``n`` due jobs of TASK by plain SQL, with ``limit_key`` ``key``."""
    await pool.execute(
        "INSERT INTO duetime.jobs (task, payload, due_at, queue, limit_key) "
        "SELECT $1, jsonb_build_object('key', coalesce($2, '')), now() - interval '1 second',"
        "       $3, $2 FROM generate_series(1, $4)",
        TASK,
        key,
        queue,
        n,
    )


async def finished(pool: asyncpg.Pool, n: int) -> bool:
    done = await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE status = 'succeeded'")
    return int(done) == n


async def test_max_running_is_never_exceeded_on_jobs_pending_before_it_was_set(
    env: Env,
) -> None:
    await insert(env.pool, env.queue, 60)  # pending before the limit exists
    await LimitStore(env.pool).set(f"task:{TASK}", 3)
    running = Running()
    async with working(env, running, concurrency=8), dispatching(env):
        await wait_for(lambda: finished(env.pool, 60), timeout=90, message="all ran")
    assert running.peak == 3  # reached, never passed (8 would run without the limit)


async def test_max_running_holds_across_a_change_of_leader(env: Env) -> None:
    await LimitStore(env.pool).set(f"task:{TASK}", 3)
    await insert(env.pool, env.queue, 80)
    running = Running()

    async def done(n: int) -> bool:
        count = await env.pool.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE status = 'succeeded'"
        )
        return int(count) >= n

    async with working(env, running, concurrency=8):
        async with dispatching(env, epoch=1):
            await wait_for(lambda: done(25), timeout=60, message="a third ran")
        # the next leader counts the slots of the jobs its predecessor dispatched
        assert await FenceStore(env.pool).advance(2, "test-node-2")
        async with dispatching(env, epoch=2):
            await wait_for(lambda: finished(env.pool, 80), timeout=90, message="all ran")
    assert running.peak == 3


async def test_a_queue_limit_holds_jobs_pending_and_counts_dispatched_ones(env: Env) -> None:
    await LimitStore(env.pool).set(f"queue:{env.queue}", 2)
    await insert(env.pool, env.queue, 10)
    async with dispatching(env):  # no worker: nothing finishes, so two stay dispatched
        await asyncio.sleep(1.5)
        rows = await env.pool.fetch(
            "SELECT status, count(*) AS n FROM duetime.jobs GROUP BY status ORDER BY status"
        )
        held = REGISTRY.get_sample_value(
            "duetime_limit_held", {"shard": "main", "limit": f"queue:{env.queue}"}
        )
        assert held == 8  # the metric counts the jobs the limit holds back
    assert {r["status"]: r["n"] for r in rows} == {"dispatched": 2, "pending": 8}
    [row] = await LimitStore(env.pool).list()
    assert (row.running, row.due) == (2, 8)
    [line] = limits_holding(await read_limits(env.pool, 5.0))  # `duetime status`
    assert line.code == "limit_holding"
    assert line.message == f"limit queue:{env.queue} holds 8 due jobs: 2 of 2 running"


async def test_a_leader_that_cannot_read_the_limits_claims_nothing(env: Env) -> None:
    """Fail closed: a new term whose first read of the limits fails (here the table is
    renamed away; in the chaos run a full connection table did it) must not dispatch
    the limited jobs unlimited, as it did when a failed read left an empty list."""
    await LimitStore(env.pool).set(f"queue:{env.queue}", 2)
    await insert(env.pool, env.queue, 10)
    await env.pool.execute("ALTER TABLE duetime.limits RENAME TO limits_away")
    try:
        async with dispatching(env):
            await asyncio.sleep(1.0)
            assert await dispatched(env.pool) == 0  # 10 before the fix
            await env.pool.execute("ALTER TABLE duetime.limits_away RENAME TO limits")

            async def two() -> bool:
                return await dispatched(env.pool) == 2

            await wait_for(two, timeout=10, message="the limit read and applied")
            await asyncio.sleep(0.5)
            assert await dispatched(env.pool) == 2
    finally:
        await env.pool.execute("ALTER TABLE IF EXISTS duetime.limits_away RENAME TO limits")


async def test_per_key_limit_caps_each_key_apart(env: Env) -> None:
    await LimitStore(env.pool).set(f"task:{TASK}", 1, per_key=True)
    for key in ("a", "b", "c"):
        await insert(env.pool, env.queue, 12, key=key)
    running = Running()
    async with working(env, running, concurrency=8), dispatching(env):
        await wait_for(lambda: finished(env.pool, 36), timeout=90, message="all ran")
    assert dict(running.peak_per_key) == {"a": 1, "b": 1, "c": 1}
    assert running.peak >= 2  # the keys do run side by side


async def test_fair_queue_starts_round_robin_between_keys(env: Env) -> None:
    """Tenant A's 2,000 due jobs came first by run time; tenant B's 10 are all among the
    first ~30 started, not after A's backlog."""
    await env.pool.execute(
        "INSERT INTO duetime.jobs (task, payload, due_at, queue, limit_key) "
        "SELECT $1, jsonb_build_object('key', 'A'), now() - interval '1 hour'"
        "       + make_interval(secs => i * 0.001), $2, 'A' FROM generate_series(1, 2000) i",
        TASK,
        env.queue,
    )
    await insert(env.pool, env.queue, 10, key="B")  # due a second ago: after every A job
    await LimitStore(env.pool).set(f"queue:{env.queue}", None, fair=True)
    running = Running()
    async with working(env, running, concurrency=4), dispatching(env):

        async def b_done() -> bool:
            return running.started.count("B") == 10

        await wait_for(b_done, timeout=60, message="B's jobs started")
    last_b = max(i for i, key in enumerate(running.started) if key == "B")
    assert last_b < 30, running.started[:40]


async def test_a_tenants_10_jobs_start_within_2_s_behind_another_tenants_10k(
    env: Env,
) -> None:
    """Issue 23's fairness target on a --fair queue: tenant A has 10,000 due jobs being
    worked off, tenant B then enqueues 10. By order (handlers' records): only the broker's
    bounded buffer of A's jobs starts before B's last; B's latency is printed and
    bounded loosely (the target is 2 s)."""
    buffer, batch = 200, 100
    await env.pool.execute(
        "INSERT INTO duetime.jobs (task, payload, due_at, queue, limit_key) "
        "SELECT $1, jsonb_build_object('key', 'A'), now() - interval '1 hour'"
        "       + make_interval(secs => i * 0.0001), $2, 'A' FROM generate_series(1, 10000) i",
        TASK,
        env.queue,
    )
    await LimitStore(env.pool).set(f"queue:{env.queue}", None, fair=True)
    starts: list[tuple[str, float]] = []
    registry = Registry()

    @registry.task(TASK)
    async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
        starts.append((payload["key"], asyncio.get_running_loop().time()))

    worker = Worker(
        env.settings, queues=[env.queue], registry=registry, concurrency=8, grace_period=5
    )
    await worker.start()
    try:
        async with dispatching(env, buffer=buffer, buffer_per_consumer=0, batch_size=batch):
            await wait_for(lambda: len(starts) >= 1000, timeout=60, message="A's backlog moving")
            before = len(starts)
            inserted_at = asyncio.get_running_loop().time()
            await insert(env.pool, env.queue, 10, key="B")

            def b_started() -> bool:
                return sum(1 for key, _ in starts if key == "B") == 10

            await wait_for(b_started, timeout=30, message="B's 10 started")
    finally:
        await worker.stop()
    after = starts[before:]
    last_b = max(i for i, (key, _) in enumerate(after) if key == "B")
    a_first = sum(1 for key, _ in after[:last_b] if key == "A")
    latency = max(at - inserted_at for key, at in after if key == "B")
    print(
        f"\n[fair] B's 10 behind {10_000 - before} of A's due: {a_first} of A's started "
        f"first (broker buffer {buffer}); B's last started {latency:.3f} s after its insert"
    )
    assert a_first <= buffer + batch + 8  # only what the broker already held
    assert latency < 5.0  # the target is 2 s (printed above); bounded loosely here


async def test_limit_key_is_checked_and_passed_through(env: Env) -> None:
    job = await JobStore(env.pool).enqueue(TASK, queue=env.queue, limit_key="tenant-1")
    key = await env.pool.fetchval("SELECT limit_key FROM duetime.jobs WHERE id = $1", job.id)
    assert key == "tenant-1"
    with pytest.raises(asyncpg.CheckViolationError) as caught:
        await env.pool.execute(
            "INSERT INTO duetime.jobs (task, queue, limit_key) VALUES ('t', $1, E'a\\nb')",
            env.queue,
        )
    assert caught.value.constraint_name == "jobs_limit_key_invalid"
    with pytest.raises(InvalidInput):
        await JobStore(env.pool).enqueue(TASK, queue=env.queue, limit_key="")
    with pytest.raises(asyncpg.CheckViolationError) as caught:
        await env.pool.execute(
            "INSERT INTO duetime.limits (target, max_running) VALUES ('job:x', 1)"
        )
    assert caught.value.constraint_name == "limits_target_invalid"
    with pytest.raises(asyncpg.CheckViolationError) as caught:
        await env.pool.execute(
            "INSERT INTO duetime.limits (target, max_running) VALUES ('task:x', 0)"
        )
    assert caught.value.constraint_name == "limits_max_running_positive"
    for values, name in [
        ("('task:x', NULL, false, false, 5, 7)", "limits_rate_invalid"),
        ("('task:x', NULL, false, false, 5, NULL)", "limits_rate_invalid"),
        ("('task:x', NULL, false, false, 0, 1)", "limits_rate_invalid"),
        ("('task:x', NULL, false, false, NULL, NULL)", "limits_rule_missing"),
        ("('task:x', 1, false, true, NULL, NULL)", "limits_fair_queue_only"),
        ("('queue:q', NULL, true, true, NULL, NULL)", "limits_per_key_needs_max"),
    ]:
        with pytest.raises(asyncpg.CheckViolationError) as caught:
            await env.pool.execute(
                "INSERT INTO duetime.limits (target, max_running, per_key, fair, rate_count,"
                f" rate_period) VALUES {values}"
            )
        assert caught.value.constraint_name == name


async def test_cli_sets_lists_removes_and_errors_in_one_line(
    env: Env, test_env: dict[str, str]
) -> None:
    cli = {**test_env, "DUETIME_DATABASE_URL": env.dsn}
    done = await run_duetime(cli, "limits", "set", "task:send_email", "--max-running", "5")
    assert done.code == 0, done.err
    assert done.out.strip() == "limit task:send_email: at most 5 running"
    done = await run_duetime(
        cli, "limits", "set", f"queue:{env.queue}", "--max-running", "2", "--per-key"
    )
    assert done.code == 0, done.err
    listed = await run_duetime(cli, "limits", "list", "--json")
    assert listed.code == 0, listed.err
    rows = {r["target"]: r for r in cast(list[dict[str, Any]], listed.json())}
    assert rows["task:send_email"]["max_running"] == 5
    assert rows[f"queue:{env.queue}"]["per_key"] is True
    done = await run_duetime(
        cli, "limits", "set", "task:call_api", "--rate", "100/min", "--per-key"
    )
    assert done.code == 0, done.err
    assert done.out.strip() == "limit task:call_api: at most 100 starts per minute per limit_key"
    listed = await run_duetime(cli, "limits", "list")
    assert listed.code == 0, listed.err
    [line] = [x for x in listed.out.splitlines() if "task:call_api" in x]
    assert "100/min" in line
    assert (await run_duetime(cli, "limits", "remove", "task:send_email")).code == 0
    for args, says in [
        (("set", "send_email", "--max-running", "5"), "task:NAME or queue:NAME"),
        (("set", "queue:bad name", "--max-running", "5"), "invalid queue name"),
        (("set", "task:x", "--max-running", "0"), "between 1 and"),
        (("set", "task:x", "--max-running", "lots"), "not a whole number"),
        (("remove", "task:send_email"), "no limit on task:send_email"),
        (("set", "task:x"), "--max-running N or --rate N/s, or --fair"),
        (("set", "task:x", "--rate", "5/day"), "N/s, N/min or N/h"),
        (("set", "task:x", "--rate", "0/s"), "between 1 and"),
        (("set", "task:x", "--fair"), "--fair applies to a queue"),
        (("set", "queue:q", "--fair", "--per-key"), "--per-key needs --max-running"),
    ]:
        run = await run_duetime(cli, "limits", *args)
        assert run.code != 0
        assert says in run.error_line(), run.err


async def test_a_unique_job_carries_its_limit_key(env: Env) -> None:
    """Migration 0017: enqueue_unique inserts the limit key (before, the API refused the
    combination), and a replace keeps the holder's own."""
    store = JobStore(env.pool)
    first = await store.enqueue(
        TASK, queue=env.queue, unique_key="u:1", limit_key="tenant-7", delay=60
    )
    held = await store.enqueue(
        TASK, {"v": 2}, queue=env.queue, unique_key="u:1", on_conflict="replace",
        limit_key="tenant-8", delay=90,
    )  # fmt: skip
    assert held.id == first.id
    key = await env.pool.fetchval("SELECT limit_key FROM duetime.jobs WHERE id = $1", first.id)
    assert key == "tenant-7"


# -- the slot wake-up (migration 0024) --------------------------------------------------

SETTLERS = {
    "complete": "SELECT duetime.worker_complete(ARRAY[$1::bigint], ARRAY[$2::timestamptz],"
    " ARRAY[1], 'w', ARRAY[NULL::jsonb])",
    "group": "SELECT * FROM duetime.worker_finish_group(ARRAY[$1::bigint],"
    " ARRAY[$2::timestamptz], ARRAY[1], 'w', $2, $2, ARRAY[NULL::jsonb])",
    "finish": "SELECT duetime.finish_attempt($1, $2, 1, 'w', NULL::jsonb)",
    "retry": "SELECT duetime.worker_retry($1, $2, 1, 60, 'e', '{}')",
    "dead": "SELECT duetime.worker_dead($1, $2, 1, 'e', '{}')",
    "snooze": "SELECT duetime.worker_snooze($1, $2, 1, 60)",
}


async def test_an_outcome_that_frees_a_slot_wakes_the_dispatcher_and_no_other_does(
    env: Env,
) -> None:
    """Every settling function the worker calls NOTIFYs duetime_jobs in its transaction
    when the job holds a max_running slot (of its task or of its queue); a job under no
    cap (none, or a rate only) sends nothing, so unlimited outcomes never take the
    notify lock."""
    limits = LimitStore(env.pool)
    await limits.set(f"task:{TASK}", 3)
    await limits.set("task:t.rated", None, rate="100/s")
    other = f"{env.queue}.capped"
    await declare_queues(env.pool, other)
    await limits.set(f"queue:{other}", 2)
    heard: list[str] = []
    listener = await asyncpg.connect(env.dsn)
    await listener.add_listener("duetime_jobs", lambda *args: heard.append(args[3]))
    cases = [(TASK, env.queue, True), ("t.free", env.queue, False)]
    cases += [("t.rated", env.queue, False), ("t.free", other, True)]
    try:
        for settler, sql in SETTLERS.items():
            for task, queue, wakes in cases:
                job = await dispatched_job(env.pool, task, queue=queue)
                async with env.pool.acquire() as conn, conn.transaction():
                    await conn.execute(sql, job.id, job.due_at)
                await asyncio.sleep(0.2)  # a NOTIFY arrives within milliseconds
                assert heard == (["slot"] if wakes else []), (settler, task, queue, heard)
                heard.clear()
    finally:
        await listener.close()


async def test_a_capped_job_starts_right_after_the_previous_one_settles(env: Env) -> None:
    """With a re-count of the limits only every second (``limits_poll`` 1 s), one slot
    and 8 jobs of 30 ms: each job starts within a claim cycle of the previous one's
    outcome, woken by the outcome's NOTIFY; before migration 0024 each waited for the
    re-count (about 0.95 s)."""
    await LimitStore(env.pool).set(f"task:{TASK}", 1)
    await insert(env.pool, env.queue, 8)
    spans: list[tuple[float, float]] = []
    registry = Registry()

    @registry.task(TASK)
    async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
        start = asyncio.get_running_loop().time()
        await asyncio.sleep(0.03)
        spans.append((start, asyncio.get_running_loop().time()))

    worker = Worker(
        env.settings, queues=[env.queue], registry=registry, concurrency=4, grace_period=5
    )
    await worker.start()
    try:
        async with dispatching(env, limits_poll=1.0):
            await wait_for(lambda: finished(env.pool, 8), timeout=30, message="all ran")
    finally:
        await worker.stop()
    gaps = sorted(b[0] - a[1] for a, b in itertools.pairwise(spans))
    print(f"\n[slot wake-up] handler end to next start, ms: {[round(g * 1000) for g in gaps]}")
    assert gaps[len(gaps) // 2] < 0.3, gaps  # measured ~0.95 s before (the re-count)


# -- rate limits (migration 0018) -------------------------------------------------------


def busiest_window(stamps: list[Any], seconds: float = 1.0) -> int:
    """The most of ``stamps`` (datetimes, with counts) in any ``seconds``-long window."""
    points = sorted(stamps)
    most = 0
    for i, (start, _) in enumerate(points):
        most = max(
            most,
            sum(n for at, n in points[i:] if (at - start).total_seconds() < seconds),
        )
    return most


async def starts_from_rows(pool: asyncpg.Pool) -> tuple[list[Any], list[Any]]:
    """(dispatched_at of every dispatched job, the start log), each as (time, count)."""
    jobs = await pool.fetch(
        "SELECT dispatched_at FROM duetime.jobs WHERE dispatched_at IS NOT NULL"
    )
    log = await pool.fetch("SELECT started_at, starts FROM duetime.limit_starts")
    return [(r["dispatched_at"], 1) for r in jobs], [(r["started_at"], r["starts"]) for r in log]


async def dispatched(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE status = 'dispatched'"))


async def test_a_rate_limit_is_never_exceeded_in_any_second(env: Env) -> None:
    await insert(env.pool, env.queue, 50)  # pending before the limit exists
    await LimitStore(env.pool).set(f"task:{TASK}", None, rate="10/s")
    async with dispatching(env):  # no worker: a start is the dispatch

        async def all_dispatched() -> bool:
            return await dispatched(env.pool) == 50

        await wait_for(all_dispatched, timeout=30, message="all dispatched")
    jobs, log = await starts_from_rows(env.pool)
    assert sum(n for _, n in log) == 50  # every start logged, once
    assert busiest_window(jobs) == 10  # reached, never passed (50 without the limit)
    assert busiest_window(log) == 10
    first, last = min(at for at, _ in jobs), max(at for at, _ in jobs)
    rate = 40 / (last - first).total_seconds()  # 4 windows after the first start
    assert 7.5 <= rate <= 10.0, rate  # measured 8.9: the window is freed on time
    [row] = await LimitStore(env.pool).list()
    assert row.limit.rate == "10/s" and row.due == 0


async def test_a_new_dispatcher_reads_the_rate_budget_from_the_rows(env: Env) -> None:
    """A leader that dispatched its second's budget is replaced at once: the new one
    (no memory of its own) must not start more in that second."""
    await LimitStore(env.pool).set(f"task:{TASK}", None, rate="10/s")
    await insert(env.pool, env.queue, 40)
    # a bucket of the whole count: the window alone shapes the starts, a second's
    # budget at once, so the first leader stops at exactly 10
    async with dispatching(env, epoch=1, rate_burst=1.0):

        async def first_budget_spent() -> bool:
            return await dispatched(env.pool) >= 10

        await wait_for(first_budget_spent, timeout=10, message="first second dispatched")
    assert await FenceStore(env.pool).advance(2, "test-node-2")
    async with dispatching(env, epoch=2, rate_burst=1.0):

        async def all_dispatched() -> bool:
            return await dispatched(env.pool) == 40

        await wait_for(all_dispatched, timeout=30, message="all dispatched")
    jobs, log = await starts_from_rows(env.pool)
    epochs = await env.pool.fetch(
        "SELECT dispatch_epoch, count(*) AS n FROM duetime.jobs GROUP BY 1 ORDER BY 1"
    )
    assert {r["dispatch_epoch"]: r["n"] for r in epochs} == {1: 10, 2: 30}
    assert busiest_window(jobs) == 10  # no burst when the new leader takes over
    assert busiest_window(log) == 10


async def test_a_rate_spreads_its_starts_over_the_period(env: Env) -> None:
    """50/s on 150 due jobs: a second's budget is not dispatched at once when the
    window frees (before the token buckets: 50 within a few milliseconds, each second)
    but in slices, so a fifth of a second holds about a fifth of the rate: 10, plus the
    bucket's 5, plus what a slow pass catches up (a loaded box: 100-200 ms a pass, so
    up to 10 more); every second still at most 50."""
    await insert(env.pool, env.queue, 150)
    await LimitStore(env.pool).set(f"task:{TASK}", None, rate="50/s")
    async with dispatching(env):  # no worker: a start is the dispatch

        async def all_dispatched() -> bool:
            return await dispatched(env.pool) == 150

        await wait_for(all_dispatched, timeout=30, message="all dispatched")
    jobs, log = await starts_from_rows(env.pool)
    print(
        f"\n[rate spread] 50/s: busiest 0.2 s {busiest_window(jobs, 0.2)}, "
        f"busiest 1 s {busiest_window(jobs)}, mean {whole_seconds_mean(jobs):.1f}/s"
    )
    assert busiest_window(jobs) <= 50
    assert busiest_window(log) <= 50
    assert busiest_window(jobs, 0.2) <= 30  # 50 before


def whole_seconds_mean(stamps: list[Any]) -> float:
    """Starts per second over the whole 1-second windows from the first start (the last,
    partial one left out): neither a first burst nor a smooth start skews it."""
    points = sorted(at for at, _ in stamps)
    first = points[0]
    seconds = int((points[-1] - first).total_seconds())
    if seconds == 0:
        return float(len(points))
    counted = sum(1 for at in points if (at - first).total_seconds() < seconds)
    return counted / seconds


async def test_a_per_key_rate_limits_each_key_apart(env: Env) -> None:
    await LimitStore(env.pool).set(f"queue:{env.queue}", None, rate="5/s", per_key=True)
    for key in ("a", "b"):
        await insert(env.pool, env.queue, 10, key=key)
    async with dispatching(env):

        async def all_dispatched() -> bool:
            return await dispatched(env.pool) == 20

        await wait_for(all_dispatched, timeout=30, message="all dispatched")
    for key in ("a", "b"):
        rows = await env.pool.fetch(
            "SELECT dispatched_at FROM duetime.jobs WHERE limit_key = $1", key
        )
        assert busiest_window([(r["dispatched_at"], 1) for r in rows]) == 5
    jobs, _ = await starts_from_rows(env.pool)
    assert busiest_window(jobs) == 10  # the keys start side by side


async def test_rate_and_max_running_hold_together(env: Env) -> None:
    """A rate with a cap: the cap binds first without workers (2 dispatched, none end)."""
    await LimitStore(env.pool).set(f"task:{TASK}", 2, rate="100/s")
    await insert(env.pool, env.queue, 10)
    async with dispatching(env):
        await asyncio.sleep(1.0)
        assert await dispatched(env.pool) == 2
    [row] = await LimitStore(env.pool).list()
    assert (row.running, row.started, row.due) == (2, 2, 8)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_rate_50_per_second_on_2000_jobs_across_a_change_of_leader(env: Env) -> None:
    """Issue 23's rate target, with the production intervals: every 1-second window
    holds at most 50 dispatches (from the rows, exact), the change of leader in the
    middle bursts nothing, the mean stays near the rate, and the handlers' own starts
    stay near 50 a second too: the token buckets spread the starts, so a worker late
    for a moment no longer starts two whole budgets close together (84 in a second
    before). Printed for docs/benchmarks.md. 600 jobs (12 s) in CI;
    ``DUETIME_TEST_SOAK=1`` runs the 2,000 of docs/benchmarks.md."""
    total = 2000 if os.environ.get("DUETIME_TEST_SOAK") == "1" else 600
    await LimitStore(env.pool).set(f"task:{TASK}", None, rate="50/s")
    await insert(env.pool, env.queue, total)
    started: list[float] = []
    registry = Registry()

    @registry.task(TASK)
    async def record(ctx: JobContext, payload: dict[str, Any]) -> None:
        started.append(asyncio.get_running_loop().time())

    worker = Worker(
        env.settings, queues=[env.queue], registry=registry, concurrency=16, grace_period=5
    )
    await worker.start()
    config = config_from_settings(DispatcherConfig, env.settings)

    async def lead(epoch: int, until: int) -> None:
        dispatcher = Dispatcher(DutyContext.standalone(env.settings, env.pool), config=config)
        dispatcher.loop.start(LeaderTerm(epoch=epoch, node_id=f"test-node-{epoch}"))
        try:

            async def reached() -> bool:
                return await dispatched_ever(env.pool) >= until

            await wait_for(reached, timeout=90, message=f"{until} dispatched")
        finally:
            await dispatcher.loop.stop()

    try:
        await lead(1, total // 2)
        assert await FenceStore(env.pool).advance(2, "test-node-2")
        await lead(2, total)
        await wait_for(lambda: len(started) >= total, timeout=30, message="all started")
    finally:
        await worker.stop()
    jobs, log = await starts_from_rows(env.pool)
    first, last = min(at for at, _ in jobs), max(at for at, _ in jobs)
    old_mean = (total - 50) / (last - first).total_seconds()  # the windows after the first
    mean = whole_seconds_mean(jobs)
    handler = [(datetime.fromtimestamp(t, UTC), 1) for t in started]
    handler_busiest = busiest_window(handler)
    print(
        f"\n[rate] 50/s on {total} jobs across a change of leader: busiest second "
        f"{busiest_window(jobs)} dispatched, {handler_busiest} handler starts; "
        f"mean {mean:.1f}/s over whole seconds ({old_mean:.1f}/s as (n - 50) / span) "
        f"over {(last - first).total_seconds():.1f} s"
    )
    assert busiest_window(jobs) <= 50
    assert busiest_window(log) <= 50
    # issue 23 asks 55 at the handlers and 45-50/s. Handlers: 50 quiet and 55 at load 6
    # measured on 2,000 (68 and 84 before), a little looser on CI's 600. The mean: 48.1
    # quiet, 44.5 at load 6 (a freed start is taken again only by a pass whose own start
    # is stamped a claim cycle later; docs/benchmarks.md), so the floor is below 45
    soak = total == 2000
    assert handler_busiest <= (55 if soak else 60), handler_busiest
    assert (42.0 if soak else 40.0) <= mean <= 50.0, mean


async def dispatched_ever(pool: asyncpg.Pool) -> int:
    return int(
        await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE dispatched_at IS NOT NULL")
    )


async def test_claims_that_skip_the_count_charge_every_job_they_dispatch(env: Env) -> None:
    """A claim that no limit can bind skips the count while the bound on the dispatched
    jobs (the last count plus every job dispatched since) leaves room for the whole
    batch (``RunningBound``). With batches of 2 and a cap of 5, the first claims go
    unlimited; a bound that missed their jobs would let a third batch through (6)."""
    await LimitStore(env.pool).set(f"task:{TASK}", 5)
    await insert(env.pool, env.queue, 20)
    async with dispatching(env, batch_size=2, limits_interval=30) as dispatcher:
        counted = 0
        real = dispatcher.limits.counts

        async def counts(*args: Any) -> Any:
            nonlocal counted
            counted += 1
            return await real(*args)

        dispatcher.limits.counts = counts  # type: ignore[method-assign]

        async def five() -> bool:
            return await dispatched(env.pool) >= 5

        await wait_for(five, timeout=10, message="the cap reached")
        await asyncio.sleep(0.5)  # passes every limits_poll, each counting
        assert await dispatched(env.pool) == 5
        assert dispatcher.running_bound.bound(f"task:{TASK}") == 5
    # the first count (0) let two batches (2 + 2) through without counting again
    assert counted >= 2


async def test_the_limited_claim_runs_on_a_generic_plan_from_its_first_execution(
    env: Env,
) -> None:
    """With a small room (``LIMIT $9`` of 1) PostgreSQL kept planning the limited claim
    on every execution (a generic plan costed for a tenth of the rows looked dearer):
    ``generic_plans`` makes the count and the claim planned once per connection, and
    the session's plan choice comes back after it."""
    store = LimitStore(env.pool)
    await store.set(f"task:{TASK}", 3)
    await insert(env.pool, env.queue, 5)
    [limit] = await store.all()
    async with env.pool.acquire() as conn, conn.transaction():
        for _ in range(7):
            async with store.generic_plans(conn):
                await store.counts(conn, [limit])
                assert len(await store.claim(conn, [limit], Closed(), 1)) == 1
        assert await conn.fetchval("SHOW plan_cache_mode") == "auto"
        plans = await conn.fetch(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE (statement LIKE '%FOR UPDATE SKIP LOCKED%' OR statement LIKE '%AS running%')"
            "   AND statement NOT LIKE '%pg_prepared_statements%'"
        )
    assert len(plans) == 2
    assert all((r["generic_plans"], r["custom_plans"]) == (7, 0) for r in plans), plans


async def test_a_freed_slot_wakes_the_dispatcher_only_while_a_limit_holds_jobs(
    env: Env,
) -> None:
    """Under a limit that does not bind, every outcome's 'slot' NOTIFY made a pass of
    its own (the storm with ``--max-running 1000000``); now it wakes the loop only while
    the last claim held jobs back. Other notifications and a lost connection wake it
    always."""
    async with dispatching(env) as dispatcher:
        woken: list[str] = []
        dispatcher.loop.wake = lambda: woken.append("wake")  # type: ignore[method-assign]

        def hear(payload: str | None) -> int:
            woken.clear()
            if payload is not None:
                dispatcher._heard(payload)
            dispatcher._woken()
            return len(woken)

        dispatcher._slots_wanted = False
        assert hear("slot") == 0
        assert (hear(""), hear(None)) == (1, 1)  # a new job; a lost LISTEN connection
        dispatcher._slots_wanted = True
        assert hear("slot") == 1
        dispatcher._limits_holding = False  # as while a claim decides: still woken
        assert hear("slot") == 1
