"""Tags and metadata on jobs (DESIGN §12; migration 0022) against real PostgreSQL:
every producer API sets them (``JobStore.enqueue`` with and without a unique key,
``bulk_enqueue``, the synchronous ``duetime.enqueue``/``bulk_enqueue``, plain SQL), the
API refuses bad values with a clear error before the database does, ``JobFilter(tags=)``
finds the jobs holding every tag through the tag index, and the migration rewrites no
bucket. Bulk cancel and retry by tag: tests/integration/test_tags_control.py.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import duetime
from scheduler import db
from scheduler.errors import InvalidInput
from scheduler.jobspec import JobSpec
from scheduler.sql import migrations
from scheduler.store.jobs import JobFilter, JobStore
from tests.conftest import own_database

pytestmark = pytest.mark.timeout(60)

#: Tags with every character COPY and array literals escape (quote, backslash, braces).
ODD = ['q"uote', "back\\slash", "{brace}", "é☃", "x" * 64]


@pytest.fixture(scope="module")
async def tags_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, "tags") as url:
        yield url


@pytest.fixture
async def pool(tags_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """The module's own database, emptied: a test's tag filters see only its jobs."""
    pool = await db.create_pool(tags_dsn, max_size=2)
    await pool.execute("DELETE FROM duetime.jobs; DELETE FROM duetime.unique_keys")
    try:
        yield pool
    finally:
        await pool.close()


async def test_every_async_producer_api_sets_tags_and_meta_and_the_filter_finds_them(
    pool: asyncpg.Pool,
) -> None:
    store = JobStore(pool)
    a = await store.enqueue(
        "t.a", {"n": 1}, delay=3600, tags=["tenant:42", "import"], meta={"by": "ada"}
    )
    b = await store.enqueue("t.b", delay=3600, tags=("tenant:42",))
    plain = await store.enqueue("t.plain", delay=3600)
    unique = await store.enqueue(
        "t.u", delay=3600, unique_key="u1", tags=["import", "u"], meta={"k": [1, 2]}
    )
    held = await store.enqueue(
        "t.u", delay=3600, unique_key="u1", on_conflict="replace", tags=["other"]
    )
    assert held.id == unique.id and held.tags == ["import", "u"]  # the holder keeps its own
    copied = await store.bulk_enqueue(
        [
            JobSpec("t.bulk", {"i": 1}, tags=ODD, meta={"note": 'tab\there "q" \\'}),
            JobSpec("t.bulk", {"i": 2}),
            JobSpec("t.bulk", {"i": 3}, tags=["import"]),
        ]
    )
    assert copied == 3
    untagged_copy = await store.bulk_enqueue([JobSpec("t.bulk2", {})])
    assert untagged_copy == 1

    assert (a.tags, a.meta, b.tags, b.meta) == (
        ["tenant:42", "import"],
        {"by": "ada"},
        ["tenant:42"],
        {},
    )
    assert (plain.tags, plain.meta) == ([], {})
    assert (await store.get(unique.id)).meta == {"k": [1, 2]}
    odd = await store.list(tags=["{brace}"])
    assert [(j.tags, j.meta) for j in odd] == [(ODD, {"note": 'tab\there "q" \\'})]

    async def ids(**filters: Any) -> list[int]:
        return [j.id for j in await store.list(**filters)]

    assert await ids(tags=["tenant:42"]) == [a.id, b.id]
    assert await ids(tags=["tenant:42", "import"]) == [a.id]  # every tag given
    assert await ids(tags=["import"], task="t.bulk") == [odd[0].id + 2]
    assert await ids(tags=["nobody"]) == []
    assert len(await ids()) == 8  # no tag: every job
    # the dashboard's read model takes the same filter
    from scheduler.store.dashboard import DashboardStore

    page = await DashboardStore(pool).jobs_page(JobFilter(tags=["import"]), limit=10)
    assert {j.id for j in page.jobs} == {a.id, unique.id, odd[0].id + 2}
    pending = await DashboardStore(pool).jobs_page(
        JobFilter(status="pending", tags=["tenant:42"]), limit=10
    )
    assert {j.id for j in pending.jobs} == {a.id, b.id}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tags": "one"}, "tags must be a list of strings, not str"),
        ({"tags": ["a b"]}, "tag 'a b' contains whitespace, a comma or a control character"),
        ({"tags": ["a,b"]}, "contains whitespace, a comma"),
        ({"tags": [""]}, "a tag must be a string of 1-64 characters"),
        ({"tags": ["x" * 65]}, "a tag must be a string of 1-64 characters"),
        ({"tags": [None]}, "a tag must be a string"),
        ({"tags": [f"t{i}" for i in range(33)]}, "a job has at most 32 tags (got 33)"),
        ({"meta": [1]}, "meta must be a JSON object (a dict), not list"),
        ({"meta": {"x": object()}}, "meta is not valid JSON"),
        ({"meta": {"big": "x" * 70000}}, "meta is 70011 bytes as JSON; at most 65536"),
    ],
)
async def test_bad_tags_and_meta_are_refused_before_the_database(
    pool: asyncpg.Pool, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)):
        await JobStore(pool).enqueue("t.bad", **options)
    with pytest.raises(InvalidInput, match=re.escape(message)):
        JobSpec("t.bad", **options)
    assert await pool.fetchval("SELECT count(*) FROM duetime.jobs") == 0


def test_a_filter_names_a_bad_tag_and_drops_repeats() -> None:
    with pytest.raises(InvalidInput, match="contains whitespace"):
        JobFilter(tags=["has space"])
    assert JobFilter(tags=["a", "b", "a"]).tags == ("a", "b")


async def test_plain_sql_sets_tags_and_meta_and_gets_the_defaults(pool: asyncpg.Pool) -> None:
    row = await pool.fetchrow(
        "INSERT INTO duetime.jobs (task, tags, meta) "
        """VALUES ('t.sql', '{tenant:7,nightly}', '{"from": "cron"}') RETURNING tags, meta"""
    )
    assert dict(row) == {"tags": ["tenant:7", "nightly"], "meta": {"from": "cron"}}
    row = await pool.fetchrow(
        "INSERT INTO duetime.jobs (task) VALUES ('t.sql') RETURNING tags, meta"
    )
    assert dict(row) == {"tags": [], "meta": {}}
    assert [j.task for j in await JobStore(pool).list(tags=["nightly"])] == ["t.sql"]


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("'{{a,b},{c,d}}'", False),  # two dimensions
        ("'{a,NULL}'", False),
        ("'{\"a b\"}'", False),
        ("'{\"\"}'", False),
        ("array_fill('t'::text, ARRAY[33])", False),
        ("array_fill('t'::text, ARRAY[32])", True),
        ("ARRAY[repeat('x', 64), 'é☃']", True),
    ],
)
async def test_the_tags_check_holds_for_plain_sql(pool: asyncpg.Pool, value: str, ok: bool) -> None:
    sql = f"INSERT INTO duetime.jobs (task, tags) VALUES ('t.chk', {value})"
    if ok:
        await pool.execute(sql)
        return
    with pytest.raises(asyncpg.CheckViolationError) as refused:
        await pool.execute(sql)
    assert refused.value.constraint_name == "jobs_tags_invalid"


def _sync_enqueue(url: str) -> list[int]:
    """``duetime.enqueue``/``bulk_enqueue`` with tags and meta through psycopg and a
    SQLAlchemy session, committed."""
    ids = []
    with psycopg.connect(url) as conn:
        with conn.transaction():
            job = duetime.enqueue(conn, "t.sync", {}, tags=["sync", "psycopg"], meta={"a": 1})
            ids.append(job.id)
            assert (job.tags, job.meta) == (["sync", "psycopg"], {"a": 1})
            unique = duetime.enqueue(
                conn, "t.sync", tags=["sync"], meta={"u": True}, unique_key="s"
            )
            ids.append(unique.id)
            assert (unique.tags, unique.meta) == (["sync"], {"u": True})
            duetime.bulk_enqueue(conn, [JobSpec("t.sync.bulk", tags=ODD, meta={"b": "\\"})])
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with Session(engine) as session, session.begin():
            ids.append(duetime.enqueue(session, "t.sync", tags=["sync", "sqlalchemy"]).id)
            with pytest.raises(InvalidInput, match="contains whitespace"):
                duetime.enqueue(session, "t.sync", tags=["no good"])
    finally:
        engine.dispose()
    return ids


async def test_synchronous_drivers_set_tags_and_meta(pool: asyncpg.Pool, tags_dsn: str) -> None:
    ids = await asyncio.to_thread(_sync_enqueue, tags_dsn)
    store = JobStore(pool)
    assert [j.id for j in await store.list(tags=["sync"])] == ids
    [bulk] = await store.list(task="t.sync.bulk")
    assert (bulk.tags, bulk.meta) == (ODD, {"b": "\\"})


async def test_a_tag_filter_reads_the_tag_index(pool: asyncpg.Pool) -> None:
    """The tagged statements are planned on jobs_tags_idx (a partial GIN index: rows
    without tags have no entry); jobs without tags never enter it."""
    store = JobStore(pool)
    await store.enqueue("t.idx", tags=["indexed"])
    await store.enqueue("t.idx")
    from scheduler.store.jobs import LIST

    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")
        where = JobFilter(tags=["indexed"])
        plan = "\n".join(
            r[0] for r in await conn.fetch("EXPLAIN " + LIST[True], *where.params(), None, None, 50)
        )
    assert "Bitmap Index Scan on jobs_p" in plan and "tags_idx" in plan, plan
    predicate = await pool.fetchval(
        "SELECT pg_get_expr(indpred, indrelid) FROM pg_index "
        "WHERE indexrelid = 'duetime.jobs_tags_idx'::regclass"
    )
    assert predicate == "(cardinality(tags) > 0)"


async def test_migration_0022_rewrites_no_bucket(fresh_dsn: str) -> None:
    """The columns come with constant defaults and the CHECKs are validated after being
    added NOT VALID: every bucket keeps its file (no rewrite) and its rows read the
    defaults."""
    conn = await db.connect(fresh_dsn)
    try:
        for version, _, sql in migrations():
            if version < 22:
                async with conn.transaction():
                    await conn.execute(sql)
        old = await conn.fetchval("INSERT INTO duetime.jobs (task) VALUES ('t.old') RETURNING id")
        files = (
            "SELECT c.relname, c.relfilenode FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'duetime.jobs'::regclass ORDER BY 1"
        )
        before = [tuple(r) for r in await conn.fetch(files)]
        [sql] = [sql for version, _, sql in migrations() if version == 22]
        async with conn.transaction():
            await conn.execute(sql)
        assert [tuple(r) for r in await conn.fetch(files)] == before
        row = await conn.fetchrow("SELECT tags, meta FROM duetime.jobs WHERE id = $1", old)
        assert dict(row) == {"tags": [], "meta": {}}
        valid = await conn.fetch(
            "SELECT conname, convalidated FROM pg_constraint "
            "WHERE conrelid = 'duetime.jobs'::regclass AND conname LIKE 'jobs_%_invalid' "
            "AND conname IN ('jobs_tags_invalid', 'jobs_meta_invalid') ORDER BY 1"
        )
        assert [tuple(r) for r in valid] == [
            ("jobs_meta_invalid", True),
            ("jobs_tags_invalid", True),
        ]
    finally:
        await conn.close()


async def test_a_dashboard_page_of_a_tag_in_few_jobs_reads_the_tag_index_and_pages_in_order(
    pool: asyncpg.Pool,
) -> None:
    """A tag held by few jobs is paged from the tag index and sorted (FEW_PAGES), not by
    walking every bucket's id index, which read each bucket without the tag to its end
    (6.2 s at 10M jobs). The pages are the same: newest first by id, keyset-paginated,
    and the pending page soonest first."""
    from datetime import UTC, datetime, timedelta

    from scheduler.store.dashboard import FEW_PAGES, DashboardStore

    store = JobStore(pool)
    now = datetime.now(UTC)
    specs = [JobSpec("t.few", due_at=now - timedelta(days=d)) for d in (0, 1, 2) for _ in range(30)]
    await store.bulk_enqueue(specs)
    tagged = [
        (await store.enqueue("t.few", due_at=now + timedelta(minutes=m), tags=["few"])).id
        for m in (5, 1, 3)
    ]
    views = DashboardStore(pool)
    seen: list[int] = []
    cursor = None
    for _ in range(3):
        page = await views.jobs_page(JobFilter(tags=["few"]), cursor=cursor, limit=2)
        seen += [j.id for j in page.jobs]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == sorted(tagged, reverse=True)
    pending = await views.jobs_page(JobFilter(status="pending", tags=["few"]), limit=50)
    assert [j.id for j in pending.jobs] == [tagged[1], tagged[2], tagged[0]]  # soonest first

    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")
        where = JobFilter(tags=["few"])
        plan = "\n".join(
            r[0]
            for r in await conn.fetch("EXPLAIN " + FEW_PAGES[None], *where.params(), None, None, 50)
        )
    assert "tags_idx" in plan and "id_idx" not in plan, plan
