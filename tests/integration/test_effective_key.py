"""A job's effective (ledger) idempotency key has one rule written twice: in Python
(``scheduler.messages.effective_key``: the ledger key of the client API, the dashboard and
the testing helpers) and in SQL, ``duetime.effective_key()`` (migration 0007), which the
worker's ``begin_deliveries`` (scheduler/sql/execution.sql) calls in the statement that
locks the row. The two must agree.

The rule also keeps producers apart (security issue, item 1): a producer's key is scoped
by the role that inserted the row, the forms the system derives (``job:<id>``,
``schedule:<id>:<fire time>``) cannot be written by a producer, so one INSERT planting
future keys can no longer settle other producers' jobs or fires as duplicates."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

import scheduler.sql
from scheduler.messages import effective_key
from scheduler.sql import load
from scheduler.store.execution import ExecutionStore
from scheduler.store.rows import Completion, JobRef
from tests.fixtures_tasks.jobs import FENCE_EPOCH, dispatched_job

#: How the worker's functions compute the key of the row they read or settle, as written
#: there (the row's alias, then these columns): migration 0019's worker_begin_jobs, 0023's
#: worker_begin_traced (begin with the trace context), worker_begin_flow (what the worker
#: calls now: plus the dependencies' outcomes; 0025, replaced by 0026 and 0030), and the settling
#: functions as migration 0024 replaced them (0019's plus the slot wake-up).
EXPRESSION = "duetime.effective_key({t}.id, {t}.idempotency_key, {t}.schedule_id, {t}.created_by)"
RESERVED = "jobs_idempotency_key_reserved"
MIGRATIONS = Path(scheduler.sql.__file__).parent / "migrations"
BEGIN = MIGRATIONS / "0019_job_control.sql"
BEGIN_TRACED = MIGRATIONS / "0023_trace_context.sql"
BEGIN_FLOW = MIGRATIONS / "0030_begin_without_ledger_hash.sql"
SETTLE = MIGRATIONS / "0024_limit_slot_wakeup.sql"


def _flat(path: Path) -> str:
    return " ".join(path.read_text("utf-8").split()).replace("( ", "(")


def test_the_worker_statement_computes_the_key_with_this_expression() -> None:
    assert "duetime.worker_begin_flow(" in load("execution")["begin_deliveries"]
    assert EXPRESSION.format(t="r") in _flat(BEGIN_FLOW)  # worker_begin_flow
    assert EXPRESSION.format(t="r") in _flat(BEGIN_TRACED)  # worker_begin_traced
    assert EXPRESSION.format(t="r") in _flat(BEGIN)  # worker_begin_jobs
    text = _flat(SETTLE)
    assert text.count(EXPRESSION.format(t="j")) == 2  # worker_complete, worker_finish_group
    assert "duetime.effective_key(id, idempotency_key, schedule_id, created_by)" in text


@pytest.mark.parametrize(
    ("key", "schedule_id", "created_by"),
    [
        (None, None, "alice"),
        ("", None, "alice"),  # the table refuses '', but the rule must not depend on it
        ("report:2031-07-01", None, "alice"),
        ("report:2031-07-01", None, None),  # rows from before migration 0005
        ("report:2031-07-01", None, "a:b"),
        ("b:report", None, "a"),
        ("schedule:7:2026-06-01T12:00:00Z", 7, "duetime_s1"),  # the planner's own
        ("schedule:7:2026-06-01T12:00:00Z", 8, "mallory"),  # not its schedule: scoped
        ("schedule:7:2026-06-01T12:00:00Z", None, "mallory"),
        ("job:43", None, "mallory"),
        ("clé ☃", None, "rôle"),  # lengths count characters on both sides
    ],
)
async def test_the_sql_function_and_the_python_function_agree(
    db_pool: asyncpg.Pool, key: str | None, schedule_id: int | None, created_by: str | None
) -> None:
    sql = "SELECT duetime.effective_key($1::bigint, $2::text, $3::bigint, $4::text)"
    assert await db_pool.fetchval(sql, 42, key, schedule_id, created_by) == effective_key(
        42, key, schedule_id=schedule_id, created_by=created_by
    )


def test_no_two_producers_share_a_key() -> None:
    """The scope is length-prefixed: no choice of role name and key spells another's."""
    one = effective_key(1, "c", schedule_id=None, created_by="a:b")
    two = effective_key(1, "b:c", schedule_id=None, created_by="a")
    assert one != two
    assert effective_key(5, None, schedule_id=None, created_by="x") == "job:5"
    planted = effective_key(9, "job:5", schedule_id=None, created_by="x")
    assert planted != "job:5" and planted.startswith("key:")


async def test_the_key_is_computed_inline_in_the_statements_that_need_it(
    db_pool: asyncpg.Pool,
) -> None:
    """duetime.effective_key is inlined into its callers (migration 0031): a function
    call left in the plan is parsed and planned again by every statement that runs it
    (the begin read, finish_attempt: once per job). Inlining needs a body no more
    volatile than the IMMUTABLE the function declares; ``'job:' || id`` on a bigint is
    only STABLE."""
    plan = await db_pool.fetchval(
        "EXPLAIN (VERBOSE, FORMAT JSON) SELECT duetime.effective_key(j.id, "
        "j.idempotency_key, j.schedule_id, j.created_by) FROM duetime.jobs j"
    )
    assert "CASE WHEN" in plan
    assert "effective_key" not in plan
    volatility = await db_pool.fetchval(
        "SELECT provolatile::text FROM pg_proc WHERE oid = "
        "'duetime.effective_key(bigint, text, bigint, text)'::regprocedure"
    )
    assert volatility == "i"


@pytest.mark.parametrize("key", [None, "report:2031-07-01"])
async def test_begin_reads_the_key_that_python_computes(
    db_pool: asyncpg.Pool, unique: str, key: str | None
) -> None:
    job = await dispatched_job(db_pool, "t.key", queue=f"q-{unique}", idempotency_key=key)
    created_by = await db_pool.fetchval("SELECT current_user")
    [locked] = await ExecutionStore(db_pool).begin([JobRef(job.id, job.due_at, 1)])
    assert locked is not None
    assert locked.key == job.key
    assert locked.key == effective_key(job.id, key, schedule_id=None, created_by=created_by)


@pytest.mark.parametrize(
    ("key", "schedule_id"),
    [
        ("job:1", None),
        ("key:5:alice:order-1", None),
        ("schedule:1:2031-01-01T00:00:00Z", None),
        ("schedule:1:2031-01-01T00:00:00Z", 2),  # another schedule's fire
        ("schedule:", None),
    ],
)
async def test_keys_in_the_forms_the_system_derives_are_refused(
    db_pool: asyncpg.Pool, key: str, schedule_id: int | None
) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as refused:
        await db_pool.execute(
            "INSERT INTO duetime.jobs (task, idempotency_key, schedule_id) VALUES ('t', $1, $2)",
            key,
            schedule_id,
        )
    assert refused.value.constraint_name == RESERVED


async def test_a_schedules_own_key_is_accepted_and_kept(db_pool: asyncpg.Pool) -> None:
    key = "schedule:3:2031-01-01T00:00:00Z"
    row = await db_pool.fetchrow(
        "INSERT INTO duetime.jobs (task, idempotency_key, schedule_id) VALUES ('t', $1, 3) "
        "RETURNING id, idempotency_key, duetime.effective_key(id, idempotency_key, "
        "schedule_id, created_by) AS effective",
        key,
    )
    assert row["idempotency_key"] == row["effective"] == key
    # ordinary keys that merely contain a reserved word are the producer's to use
    for ok in ("order:job:1", "jobs:1", "Job:1", "schedule-1"):
        await db_pool.execute(
            "INSERT INTO duetime.jobs (task, idempotency_key) VALUES ('t', $1)", ok
        )


async def _dispatched_as(
    pool: asyncpg.Pool, queue: str, key: str, created_by: str
) -> tuple[JobRef, str]:
    """A job inserted as if by ``created_by`` (the owner may set the column; a producer
    role cannot), claimed as the dispatcher would. Returns its ref and its ledger key."""
    row = await pool.fetchrow(
        "INSERT INTO duetime.jobs (task, queue, idempotency_key, created_by) "
        "VALUES ('t.scope', $1, $2, $3) RETURNING id, due_at",
        queue,
        key,
        created_by,
    )
    await pool.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        f"dispatch_epoch = {FENCE_EPOCH} WHERE id = $1",
        row["id"],
    )
    ref = JobRef(row["id"], row["due_at"], 1)
    return ref, effective_key(row["id"], key, schedule_id=None, created_by=created_by)


async def test_one_producers_key_never_settles_another_producers_job(
    db_pool: asyncpg.Pool, unique: str
) -> None:
    """Two producers using the same key: each job runs (its own ledger row); a second
    job of the same producer with that key is still a duplicate."""
    store = ExecutionStore(db_pool)
    queue = f"q-{unique}"
    alice, alice_key = await _dispatched_as(db_pool, queue, "order:1", "alice")
    bob, bob_key = await _dispatched_as(db_pool, queue, "order:1", "bob")
    assert alice_key != bob_key
    [locked] = await store.begin([alice])
    assert locked is not None and not locked.done and locked.key == alice_key
    assert await store.complete([Completion(alice, locked.key, "t.scope")], "w") == {alice.job_id}

    [locked_bob] = await store.begin([bob])
    assert locked_bob is not None and locked_bob.key == bob_key
    assert not locked_bob.done, "alice's key settled bob's job"

    again, _ = await _dispatched_as(db_pool, queue, "order:1", "alice")
    [locked_again] = await store.begin([again])
    assert locked_again is not None and locked_again.done


async def test_a_planted_future_key_does_not_settle_the_job_it_names(
    db_pool: asyncpg.Pool, unique: str
) -> None:
    """The attack of the issue: mallory plants `job:<next id>` and the next fire time of
    a schedule. Both are refused; the job that gets that id (no key of its own) and the
    planner-style job of that fire run instead of being settled as duplicates."""
    store = ExecutionStore(db_pool)
    queue = f"q-{unique}"
    # a sequence nobody has called yet hands out last_value itself first
    nxt = await db_pool.fetchval(
        "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END "
        "FROM duetime.jobs_id_seq"
    )
    fire = f"schedule:77:{datetime(2031, 1, 1, tzinfo=UTC):%Y-%m-%dT%H:%M:%SZ}"
    # each refused INSERT still takes an id (the column default runs first): the two
    # attempts take nxt and nxt + 1, the victim gets nxt + 2
    for key in (f"job:{nxt + 2}", fire):
        with pytest.raises(asyncpg.CheckViolationError) as refused:
            await _dispatched_as(db_pool, queue, key, "mallory")
        assert refused.value.constraint_name == RESERVED
    victim = await dispatched_job(db_pool, "t.victim", queue=queue)
    assert victim.key == f"job:{victim.id}" and victim.id == nxt + 2
    row = await db_pool.fetchrow(
        "INSERT INTO duetime.jobs (task, queue, idempotency_key, schedule_id) "
        "VALUES ('t.fire', $1, $2, 77) RETURNING id, due_at",
        queue,
        fire,
    )
    refs = [JobRef(victim.id, victim.due_at, 1), JobRef(row["id"], row["due_at"], 1)]
    locked = await store.begin(refs)
    assert [(j.key, j.done) for j in locked if j is not None] == [
        (f"job:{victim.id}", False),
        (fire, False),
    ]
