"""Workflows (DESIGN §16; migration 0025) against real PostgreSQL and RabbitMQ: jobs that
wait for other jobs, declared with plain SQL, released by the transaction that commits a
dependency's outcome, run by a real dispatcher and worker.

Each test has a database of its own (``migrated_dsn``), an in-process dispatcher (as
tests/integration/test_priority.py) and an in-process worker whose handlers record what
they saw in ``ctx.dependencies``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import pytest

from scheduler import db
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher, DispatcherConfig
from scheduler.duties.knobs import config_from_settings
from scheduler.store.dispatch import DispatchStore
from scheduler.store.fence import FenceStore
from scheduler.store.jobs import JobFilter, JobStore
from tests.support.helpers import declare_queues
from tests.support.wait import wait_for
from workers import Fail, JobContext, Registry, Retry, Worker

pytestmark = pytest.mark.timeout(120)


@dataclass
class Env:
    settings: Settings
    pool: asyncpg.Pool
    queue: str
    #: (job id, task, [(dep id, status, result)]) in start order
    seen: list[tuple[int, str, list[tuple[int, str, Any]]]] = field(default_factory=list)


@pytest.fixture
async def env(migrated_dsn: str, settings: Settings, unique: str) -> AsyncIterator[Env]:
    pool = await db.create_pool(
        migrated_dsn, max_size=8, server_settings={"idle_in_transaction_session_timeout": "10000"}
    )
    try:
        assert await FenceStore(pool).advance(1, "test-node")
        await declare_queues(pool, unique)
        yield Env(dataclasses.replace(settings, database_url=migrated_dsn), pool, unique)
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def running(env: Env) -> AsyncIterator[None]:
    """A dispatcher and a worker on the env's queue. Tasks: ``wf.step`` returns its
    payload's ``value`` (or fails as its payload says), recording what it saw."""
    registry = Registry()

    @registry.task("wf.step")
    async def step(ctx: JobContext, payload: dict[str, Any]) -> Any:
        env.seen.append(
            (ctx.job_id, ctx.task, [(d.id, d.status, d.result) for d in ctx.dependencies])
        )
        if payload.get("fail") == "dead":
            raise Fail("it broke")
        if payload.get("fail") == "once" and ctx.attempt == 1:
            raise Retry(in_=1.0)
        return payload.get("value")

    config = config_from_settings(DispatcherConfig, env.settings)
    dispatcher = Dispatcher(DutyContext.standalone(env.settings, env.pool), config=config)
    dispatcher.loop.start(LeaderTerm(epoch=1, node_id="test-node"))
    worker = Worker(
        env.settings, queues=[env.queue], registry=registry, concurrency=8, grace_period=5
    )
    await worker.start()
    try:
        yield
    finally:
        await worker.stop()
        await dispatcher.loop.stop()


async def insert(
    pool: asyncpg.Pool | asyncpg.Connection,
    queue: str,
    payload: dict[str, Any] | None = None,
    *,
    depends_on: list[int] | None = None,
    on_failure: str = "cancel",
    delay_s: float = 0.0,
) -> int:
    """One ``wf.step`` job by plain SQL; its id."""
    return int(
        await pool.fetchval(
            "INSERT INTO duetime.jobs (task, payload, queue, depends_on, on_dependency_failure,"
            "                          due_at) "
            "VALUES ('wf.step', $1, $2, $3, $4, now() + make_interval(secs => $5)) "
            "RETURNING id",
            payload or {},
            queue,
            depends_on,
            on_failure,
            delay_s,
        )
    )


async def status(pool: asyncpg.Pool, job_id: int) -> str:
    return str(await pool.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job_id))


async def row(pool: asyncpg.Pool, job_id: int) -> asyncpg.Record:
    record = await pool.fetchrow("SELECT * FROM duetime.jobs WHERE id = $1", job_id)
    assert record is not None
    return record


async def all_in(pool: asyncpg.Pool, ids: list[int], *statuses: str) -> bool:
    got = await pool.fetch("SELECT status FROM duetime.jobs WHERE id = ANY($1)", ids)
    return len(got) == len(ids) and all(r["status"] in statuses for r in got)


# -- plain SQL: insert-time rules --------------------------------------------------------


async def test_a_dependency_must_exist_and_the_refusal_names_the_constraint(env: Env) -> None:
    with pytest.raises(asyncpg.ForeignKeyViolationError) as err:
        await insert(env.pool, env.queue, depends_on=[987654321])
    assert err.value.constraint_name == "jobs_depends_on_missing"
    assert "987654321" in str(err.value)


async def test_the_begin_reads_dependencies_only_for_a_job_that_has_them(env: Env) -> None:
    """The begin statement of every delivery (worker_begin_flow) reads a job's
    dependencies through duetime.dependency_outcomes, called for a job with depends_on
    only (migration 0026): a subquery over every bucket in the statement itself cost
    jobs without dependencies 0.5 ms of PostgreSQL CPU each (docs/benchmarks.md)."""
    a = await insert(env.pool, env.queue, delay_s=3600)
    b = await insert(env.pool, env.queue, depends_on=[a])
    async with env.pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL track_functions = 'pl'")
        refs = await conn.fetch(
            "SELECT id, due_at FROM duetime.jobs WHERE id = ANY($1) ORDER BY id", [a, b]
        )
        rows = await conn.fetch(
            "SELECT i, dependencies FROM duetime.worker_begin_flow("
            "$1, $2, '{1,1}', '{0,0}', '{}', '{}', '{}') ORDER BY i",
            [r["id"] for r in refs],
            [r["due_at"] for r in refs],
        )
        calls = await conn.fetchval(
            "SELECT pg_stat_get_xact_function_calls("
            "'duetime.dependency_outcomes(bigint[])'::regprocedure)"
        )
    assert rows[0]["dependencies"] is None
    assert [d["id"] for d in rows[1]["dependencies"]] == [a]
    assert calls == 1


@pytest.mark.parametrize(
    ("column", "value", "constraint"),
    [
        ("on_dependency_failure", "'maybe'", "jobs_on_dependency_failure_invalid"),
        ("workflow_id", "0", "jobs_workflow_id_invalid"),
        ("depends_on", "'{{1,2},{3,4}}'::bigint[]", "jobs_depends_on_invalid"),
        ("depends_on", "ARRAY[NULL]::bigint[]", "jobs_depends_on_invalid"),
        ("status", "'waiting'", "jobs_waiting_without_dependencies"),
        ("unique_key, depends_on", "'k', '{}'::bigint[]", "jobs_unique_key_with_depends_on"),
    ],
)
async def test_workflow_columns_are_checked_by_named_constraints(
    env: Env, column: str, value: str, constraint: str
) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as err:
        await env.pool.execute(
            f"INSERT INTO duetime.jobs (task, {column}) VALUES ('wf.step', {value})"
        )
    assert err.value.constraint_name == constraint


async def test_insert_time_classification(env: Env) -> None:
    """Unfinished dependency: waiting; all succeeded: pending; one dead: cancelled (with
    the reason), or pending with ``run``; an empty array: a plain job."""
    a = await insert(env.pool, env.queue, delay_s=3600)
    waiting = await insert(env.pool, env.queue, depends_on=[a, a])
    assert await status(env.pool, waiting) == "waiting"
    assert await DispatchStore(env.pool).waiting() == 1  # the duetime_waiting_jobs gauge
    edges = await env.pool.fetchval(
        "SELECT count(*) FROM duetime.job_dependencies WHERE dependent_id = $1", waiting
    )
    assert edges == 1  # duplicates collapse
    await env.pool.execute(
        "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now() WHERE id = $1", a
    )
    assert await status(env.pool, waiting) == "pending"
    assert await status(env.pool, await insert(env.pool, env.queue, depends_on=[a])) == "pending"
    dead = await insert(env.pool, env.queue, delay_s=3600)
    await env.pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', last_error = 'boom' WHERE id = $1", dead
    )
    late = await row(env.pool, await insert(env.pool, env.queue, depends_on=[a, dead]))
    assert (late["status"], late["cancelled_by"]) == ("cancelled", "dependency")
    assert late["last_error"] == f"dependency {dead} (wf.step) dead: boom"
    runs = await insert(env.pool, env.queue, depends_on=[dead], on_failure="run")
    assert await status(env.pool, runs) == "pending"
    assert await status(env.pool, await insert(env.pool, env.queue, depends_on=[])) == "pending"


async def test_concurrent_last_completions_release_exactly_once(env: Env) -> None:
    """The tail of a fan-in: the last members' outcomes are settled concurrently, each in
    a transaction that cannot see the others' deletions before it commits (cases 2 and 3
    of migration 0025). The callback is released, and its edges are all gone."""
    for _ in range(20):
        members = [await insert(env.pool, env.queue, delay_s=3600) for _ in range(3)]
        callback = await insert(env.pool, env.queue, depends_on=members)

        async def settle(member: int) -> None:
            async with env.pool.acquire() as c, c.transaction():
                await c.execute(
                    "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now() "
                    "WHERE id = $1",
                    member,
                )
                await asyncio.sleep(0.05)  # the others settle meanwhile, unseen

        await asyncio.gather(*(settle(m) for m in members))
        assert await status(env.pool, callback) == "pending"
        assert not await env.pool.fetchval(
            "SELECT count(*) FROM duetime.job_dependencies WHERE dependent_id = $1", callback
        )


# -- end to end: dispatcher + worker -----------------------------------------------------


async def test_a_chain_of_three_runs_in_order_and_passes_results(env: Env) -> None:
    async with running(env):
        a = await insert(env.pool, env.queue, {"value": "A"})
        b = await insert(env.pool, env.queue, {"value": "B"}, depends_on=[a])
        c = await insert(env.pool, env.queue, {"value": "C"}, depends_on=[b])
        await wait_for(lambda: all_in(env.pool, [a, b, c], "succeeded"), timeout=30)
    assert [s[0] for s in env.seen] == [a, b, c]
    assert env.seen[0][2] == []
    assert env.seen[1][2] == [(a, "succeeded", "A")]
    assert env.seen[2][2] == [(b, "succeeded", "B")]
    rows = [await row(env.pool, j) for j in (a, b, c)]
    # each step became runnable only once its dependency had finished
    assert rows[1]["run_at"] >= rows[0]["finished_at"]
    assert rows[2]["run_at"] >= rows[1]["finished_at"]


async def test_fan_in_callback_runs_once_after_every_member(env: Env) -> None:
    async with running(env):
        members = [await insert(env.pool, env.queue, {"value": i}) for i in range(40)]
        callback = await insert(env.pool, env.queue, {"value": "sum"}, depends_on=members)
        await wait_for(lambda: all_in(env.pool, [*members, callback], "succeeded"), timeout=60)
    runs = [s for s in env.seen if s[0] == callback]
    assert len(runs) == 1
    assert runs[0][2] == [(m, "succeeded", i) for i, m in enumerate(members)]
    started = [s[0] for s in env.seen]
    assert started.index(callback) == len(started) - 1


async def test_a_dead_member_cancels_the_callback_transitively_with_the_reason(
    env: Env,
) -> None:
    async with running(env):
        ok = await insert(env.pool, env.queue, {"value": 1})
        bad = await insert(env.pool, env.queue, {"fail": "dead"})
        callback = await insert(env.pool, env.queue, depends_on=[ok, bad])
        after = await insert(env.pool, env.queue, depends_on=[callback])
        await wait_for(lambda: all_in(env.pool, [after], "cancelled"), timeout=30)
        await asyncio.sleep(0.3)
    cb = await row(env.pool, callback)
    assert (cb["status"], cb["cancelled_by"]) == ("cancelled", "dependency")
    assert cb["last_error"].startswith(f"dependency {bad} (wf.step) dead: ")
    assert (await row(env.pool, after))["last_error"].startswith(
        f"dependency {callback} (wf.step) cancelled: dependency {bad} (wf.step) dead"
    )
    assert {s[0] for s in env.seen} == {ok, bad}  # neither dependent ran
    assert not await env.pool.fetchval("SELECT count(*) FROM duetime.job_dependencies")


async def test_run_mode_callback_runs_and_sees_the_failed_member(env: Env) -> None:
    async with running(env):
        ok = await insert(env.pool, env.queue, {"value": 1})
        bad = await insert(env.pool, env.queue, {"fail": "dead"})
        callback = await insert(env.pool, env.queue, depends_on=[ok, bad], on_failure="run")
        await wait_for(lambda: all_in(env.pool, [callback], "succeeded"), timeout=30)
    (run,) = [s for s in env.seen if s[0] == callback]
    assert run[2] == [(ok, "succeeded", 1), (bad, "dead", None)]


async def test_a_dependency_cancelled_while_its_dependent_waits(env: Env) -> None:
    store = JobStore(env.pool)
    async with running(env):
        later = await insert(env.pool, env.queue, delay_s=3600)
        dependent = await insert(env.pool, env.queue, depends_on=[later])
        assert await status(env.pool, dependent) == "waiting"
        await store.cancel(later, by="test")
        d = await row(env.pool, dependent)
        assert (d["status"], d["last_error"]) == (
            "cancelled",
            f"dependency {later} (wf.step) cancelled",
        )
        # a waiting job can be cancelled itself; its edges go with it
        other = await insert(env.pool, env.queue, delay_s=3600)
        waiting = await insert(env.pool, env.queue, depends_on=[other])
        assert (await store.cancel(waiting)).status == "cancelled"
        assert not await env.pool.fetchval("SELECT count(*) FROM duetime.job_dependencies")
    assert env.seen == []


async def test_a_long_chain_is_cancelled_by_its_first_step_in_one_statement(env: Env) -> None:
    """A dependency that ends dead cancels every waiting job downstream in one statement
    (migration 0027): one nested trigger per level overflowed PostgreSQL's stack from
    about 500 levels, and the dead outcome could not commit. 1,000 steps here."""
    ids = [await insert(env.pool, env.queue, delay_s=3600)]
    async with env.pool.acquire() as conn, conn.transaction():
        for _ in range(999):
            ids.append(await insert(conn, env.queue, depends_on=[ids[-1]]))
    await env.pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', finished_at = now(), last_error = 'boom' "
        "WHERE id = $1",
        ids[0],
    )
    assert await all_in(env.pool, ids[1:], "cancelled")
    second, third, last = [await row(env.pool, i) for i in (ids[1], ids[2], ids[-1])]
    assert second["last_error"] == f"dependency {ids[0]} (wf.step) dead: boom"
    # further down: the job it waited for, then the root cause
    assert third["last_error"] == (
        f"dependency {ids[1]} (wf.step) cancelled: dependency {ids[0]} (wf.step) dead: boom"
    )
    assert last["last_error"].startswith(f"dependency {ids[-2]} (wf.step) cancelled: ")
    assert {second["cancelled_by"], last["cancelled_by"]} == {"dependency"}
    assert not await env.pool.fetchval("SELECT count(*) FROM duetime.job_dependencies")


async def test_a_cancel_cascade_releases_run_dependents_and_spares_other_branches(
    env: Env,
) -> None:
    """A diamond under a failed root: both sides and their join are cancelled once; a
    dependent that runs on failure is released (pending) when the cascade reaches it,
    and a job that also waits for an unrelated, unfinished job stays waiting only on that
    one if it runs on failure."""
    root = await insert(env.pool, env.queue, delay_s=3600)
    other = await insert(env.pool, env.queue, delay_s=3600)
    left = await insert(env.pool, env.queue, depends_on=[root])
    right = await insert(env.pool, env.queue, depends_on=[root])
    join = await insert(env.pool, env.queue, depends_on=[left, right])
    cleanup = await insert(env.pool, env.queue, depends_on=[join], on_failure="run")
    mixed = await insert(env.pool, env.queue, depends_on=[join, other], on_failure="run")
    await env.pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', finished_at = now() WHERE id = $1", root
    )
    assert await all_in(env.pool, [left, right, join], "cancelled")
    assert (await row(env.pool, join))["last_error"] == (
        f"dependency {left} (wf.step) cancelled: dependency {root} (wf.step) dead"
    )
    assert await status(env.pool, cleanup) == "pending"
    assert await status(env.pool, mixed) == "waiting"
    assert await env.pool.fetchval(
        "SELECT array_agg(dependency_id) FROM duetime.job_dependencies"
    ) == [other]


async def test_bulk_cancel_by_tag_takes_waiting_jobs_and_their_dependents(env: Env) -> None:
    store = JobStore(env.pool)
    first = await insert(env.pool, env.queue, delay_s=3600)
    waiting = await insert(env.pool, env.queue, depends_on=[first])
    after = await insert(env.pool, env.queue, depends_on=[waiting])
    await env.pool.execute(
        "UPDATE duetime.jobs SET tags = '{batch:7}' WHERE id = ANY($1)", [first, waiting]
    )
    where = JobFilter(tags=["batch:7"])
    assert (await store.preview_matching("cancel", where)).count == 2
    assert (await store.preview_matching("cancel", JobFilter(status="waiting"))).count == 2
    assert await store.cancel_matching(where, by="test") == 2
    assert await all_in(env.pool, [first, waiting, after], "cancelled")
    assert (await row(env.pool, after))["last_error"].startswith(f"dependency {waiting} ")
    assert not await env.pool.fetchval("SELECT count(*) FROM duetime.job_dependencies")


async def test_a_retried_dependency_keeps_its_dependents_waiting(env: Env) -> None:
    async with running(env):
        flaky = await insert(env.pool, env.queue, {"fail": "once", "value": "second try"})
        dependent = await insert(env.pool, env.queue, depends_on=[flaky])
        # One snapshot of both rows while the retry is on its way (pending, staged or
        # running at attempt 2, for at least the retry's 1 s): the dependent waits. Two
        # reads could see the retry succeed in between; a wait for 'pending' alone could
        # miss it, since staging dispatches a retry due within the horizon at once.
        retried, dependent_status = await wait_for(
            lambda: env.pool.fetchrow(
                "SELECT f.attempt = 2 AND f.status <> 'succeeded' AS retried, d.status"
                "  FROM duetime.jobs AS f, duetime.jobs AS d WHERE f.id = $1 AND d.id = $2"
                "   AND f.attempt = 2 AND f.status <> 'succeeded'",
                flaky,
                dependent,
            ),
            timeout=30,
        )
        assert retried and dependent_status == "waiting"
        await wait_for(lambda: all_in(env.pool, [dependent], "succeeded"), timeout=30)
    (run,) = [s for s in env.seen if s[0] == dependent]
    assert run[2] == [(flaky, "succeeded", "second try")]


# -- the Python API: duetime.workflow ----------------------------------------------------


async def test_enqueue_workflow_runs_a_chord_end_to_end(env: Env) -> None:
    from duetime.workflow import chain, chord, step

    store = JobStore(env.pool)
    fan = chord(
        [step("wf.step", {"value": i}, queue=env.queue) for i in range(5)],
        step("wf.step", {"value": "cb"}, queue=env.queue),
    )
    wf = chain(step("wf.step", {"value": "first"}, queue=env.queue), fan)
    async with running(env):
        run = await store.enqueue_workflow(wf)
        assert [j.status for j in run.jobs] == ["pending"] + ["waiting"] * 6
        assert {j.workflow_id for j in run.jobs} == {run.workflow_id}
        assert run.jobs[-1].depends_on == run.ids[1:6]
        await wait_for(lambda: all_in(env.pool, run.ids, "succeeded"), timeout=30)
    (cb,) = [s for s in env.seen if s[0] == run.ids[-1]]
    assert cb[2] == [(run.ids[1 + i], "succeeded", i) for i in range(5)]
    assert [j.id for j in await store.workflow(run.workflow_id)] == run.ids


async def test_enqueue_workflow_is_one_transaction_and_cancel_workflow(env: Env) -> None:
    from duetime.workflow import chain, step

    store = JobStore(env.pool)
    bad = chain(step("wf.step", queue=env.queue), step("wf.step", {"x": 1}, max_attempts=0))
    with pytest.raises(asyncpg.CheckViolationError):
        await store.enqueue_workflow(bad)
    assert not await env.pool.fetchval("SELECT count(*) FROM duetime.jobs")
    run = await store.enqueue_workflow(
        chain(*(step("wf.step", queue=env.queue, delay=3600) for _ in range(3)))
    )
    assert await store.cancel_workflow(run.workflow_id, by="test") == 3
    assert await all_in(env.pool, run.ids, "cancelled")
    assert await store.cancel_workflow(run.workflow_id) == 0


def test_the_sync_producer_inserts_a_workflow_in_the_callers_transaction(
    migrated_dsn: str,
) -> None:
    import psycopg

    import duetime
    from duetime.workflow import chord, step

    with psycopg.connect(migrated_dsn) as conn:
        run = duetime.enqueue_workflow(
            conn, chord([step("wf.step", {"i": i}) for i in range(3)], step("wf.step"))
        )
        assert [j.status for j in run.jobs] == ["pending"] * 3 + ["waiting"]
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM duetime.jobs").fetchone() == (0,)
        run = duetime.enqueue_workflow(conn, chord([step("wf.step")], step("wf.step")))
        conn.commit()
        got = conn.execute(
            "SELECT depends_on, status FROM duetime.jobs WHERE id = %s", (run.ids[-1],)
        ).fetchone()
    assert got == ([run.ids[0]], "waiting")
