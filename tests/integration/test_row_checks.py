"""The jobs table's CHECKs and UPDATE-trigger conditions after migration 0029: the same
rules, under the same names, run as one PL/pgSQL call each (prepared once per
connection instead of once per statement; docs/benchmarks.md, "What a one-row statement
on jobs pays for its CHECKs and trigger conditions").

Two things could go wrong in that move, and each has a test: a rule that no longer says
what it said (every function is compared with the expression it replaced, value by
value, NULLs included), and a rule whose meaning a caller's search_path can change (the
expressions were resolved when they were created; a function body is resolved when it
first runs, in the caller's session).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import asyncpg
import pytest

from scheduler import db
from scheduler.sql import migrations
from tests.conftest import own_database

#: constraint -> (the expression it held before 0029, over a row `r`; the columns and
#: types of `r`; values to compare on, as SQL literals of those types)
RULES: dict[str, tuple[str, str, list[str]]] = {
    "jobs_idempotency_key_invalid": (
        "r.idempotency_key IS NULL OR (length(r.idempotency_key) >= 1"
        " AND length(r.idempotency_key) <= 500)",
        "idempotency_key text",
        ["NULL", "''", "'a'", "repeat('k', 500)", "repeat('k', 501)"],
    ),
    "jobs_idempotency_key_reserved": (
        "r.idempotency_key IS NULL OR NOT (starts_with(r.idempotency_key, 'job:')"
        " OR starts_with(r.idempotency_key, 'key:')"
        " OR starts_with(r.idempotency_key, 'schedule:'))"
        " OR (r.schedule_id IS NOT NULL"
        " AND starts_with(r.idempotency_key, 'schedule:' || r.schedule_id || ':'))",
        "idempotency_key text, schedule_id bigint",
        [
            "(NULL, NULL)",
            "('mine', NULL)",
            "('job:1', NULL)",
            "('key:x', 7)",
            "('schedule:7:2026', NULL)",
            "('schedule:7:2026', 7)",
            "('schedule:7:2026', 8)",
            "('schedule:70:1', 7)",
            "('jobs', NULL)",
        ],
    ),
    "jobs_tags_invalid": (
        "cardinality(r.tags) = 0 OR (cardinality(r.tags) <= 32 AND array_ndims(r.tags) = 1"
        " AND array_position(r.tags, NULL) IS NULL AND array_to_string(r.tags, ',')"
        r" ~ '^[^\x01-\x20\x7f-\x9f,]{1,64}(,[^\x01-\x20\x7f-\x9f,]{1,64})*$')",
        "tags text[]",
        [
            "'{}'",
            "'{a,b}'",
            "ARRAY['a b']",
            "ARRAY['a,b']",
            "ARRAY['']",
            "ARRAY[NULL::text]",
            "ARRAY[repeat('t', 64)]",
            "ARRAY[repeat('t', 65)]",
            "ARRAY[E'tab\\there']",
            "ARRAY[E'ctl\\u0085x']",
            "ARRAY['caf\u00e9', '\u65e5\u672c']",
            "ARRAY[ARRAY['a'], ARRAY['b']]",
            "(SELECT array_agg(g::text) FROM generate_series(1, 32) g)",
            "(SELECT array_agg(g::text) FROM generate_series(1, 33) g)",
        ],
    ),
    "jobs_depends_on_invalid": (
        "r.depends_on IS NULL OR array_ndims(r.depends_on) IS NULL"
        " OR (array_ndims(r.depends_on) = 1 AND cardinality(r.depends_on) <= 100000"
        " AND array_position(r.depends_on, NULL::bigint) IS NULL)",
        "depends_on bigint[]",
        [
            "NULL",
            "'{}'",
            "'{1,2}'",
            "ARRAY[1, NULL]",
            "ARRAY[ARRAY[1], ARRAY[2]]",
            "(SELECT array_agg(g) FROM generate_series(1, 100001) g)",
        ],
    ),
    "jobs_traceparent_invalid": (
        "r.traceparent IS NULL OR (r.traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'"
        " AND substr(r.traceparent, 4, 32) <> '00000000000000000000000000000000'"
        " AND substr(r.traceparent, 37, 16) <> '0000000000000000')",
        "traceparent text",
        [
            "NULL",
            "'00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'",
            "'00-00000000000000000000000000000000-00f067aa0ba902b7-01'",
            "'00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01'",
            "'01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'",
            "'00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01'",
            "''",
        ],
    ),
    "jobs_meta_invalid": (
        "jsonb_typeof(r.meta) = 'object' AND CASE WHEN pg_column_compression(r.meta) IS NULL"
        " THEN pg_column_size(r.meta) ELSE pg_column_size(r.meta || '{}'::jsonb) END <= 65536",
        "meta jsonb",
        [
            "'{}'",
            "'[]'",
            "'3'",
            "'null'",
            "jsonb_build_object('k', repeat('m', 65000))",
            "jsonb_build_object('k', repeat('m', 66000))",
        ],
    ),
    "jobs_payload_too_large": (
        "CASE WHEN pg_column_compression(r.payload) IS NULL THEN pg_column_size(r.payload)"
        " ELSE pg_column_size(r.payload || '{}'::jsonb) END <= 1048576",
        "payload jsonb",
        [
            "'{}'",
            "jsonb_build_object('k', repeat('p', 1048000))",
            "jsonb_build_object('k', repeat('p', 1049000))",
        ],
    ),
    "jobs_status_invalid": (
        "r.status = ANY (ARRAY['pending', 'dispatched', 'succeeded', 'dead', 'cancelled',"
        " 'waiting'])",
        "status text",
        ["'pending'", "'waiting'", "'cancelled'", "'running'", "''", "'Pending'"],
    ),
    "jobs_waiting_without_dependencies": (
        "r.status <> 'waiting' OR coalesce(cardinality(r.depends_on), 0) > 0",
        "status text, depends_on bigint[]",
        [
            "('pending', NULL)",
            "('waiting', NULL)",
            "('waiting', '{}')",
            "('waiting', '{1}')",
            "('dead', '{}')",
        ],
    ),
    "jobs_queue_name_invalid": (
        "r.queue ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$'",
        "queue text",
        [
            "'default'",
            "'a.b-c_d'",
            "''",
            "'bad queue'",
            "'-x'",
            "repeat('q', 100)",
            "repeat('q', 101)",
        ],
    ),
    "jobs_progress_out_of_range": (
        "r.progress IS NULL OR (r.progress >= 0::float8 AND r.progress <= 1::float8)",
        "progress real",
        ["NULL", "0", "0.5", "1", "1.0001", "-0.0001", "'NaN'", "'Infinity'"],
    ),
    "jobs_timeout_s_out_of_range": (
        "r.timeout_s IS NULL OR (r.timeout_s > 0::float8 AND r.timeout_s <= 604800::float8)",
        "timeout_s float8",
        ["NULL", "0", "0.001", "604800", "604800.5", "-1", "'NaN'", "'Infinity'"],
    ),
}


@pytest.fixture(scope="module")
async def checks_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, "row_checks") as url:
        yield url


@pytest.fixture
async def conn(checks_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await db.connect(checks_dsn)
    try:
        yield connection
    finally:
        await connection.close()


#: the functions of one constraint each (meta and payload share check_json_object_size)
_FUNCTIONS = (
    "idempotency_key",
    "idempotency_key_reserved",
    "tags",
    "depends_on",
    "traceparent",
    "status",
    "waiting_has_dependencies",
    "queue_name",
    "progress",
    "timeout_s",
)


#: the trigger conditions' functions
_WHEN = (
    "dispatch_fenced",
    "unique_release",
    "unique_revive",
    "unique_key_fixed",
    "release_dependents",
    "finished",
)


def _split(row: str) -> list[str]:
    """'(a, b)' -> ['a', 'b'] (the multi-column values above hold no commas inside)."""
    return [part.strip() for part in row.removeprefix("(").removesuffix(")").split(",")]


@pytest.mark.parametrize("constraint", sorted(RULES))
async def test_each_check_function_says_what_its_constraint_said(
    conn: asyncpg.Connection, constraint: str
) -> None:
    """Value by value, the function the constraint calls now and the expression it held
    before agree: true, false and NULL (a CHECK passes on NULL) alike."""
    old, spec, values = RULES[constraint]
    definition = await conn.fetchval(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = 'duetime.jobs'::regclass AND conname = $1",
        constraint,
    )
    assert definition is not None, constraint
    assert definition.startswith("CHECK (duetime.check_"), definition
    call = definition.removeprefix("CHECK (").removesuffix(" NOT VALID").removesuffix(")")
    columns = [(part.split()[0], part.split()[1]) for part in spec.split(", ")]
    for name, _ in columns:
        call = re.sub(rf"\b{name}\b", f"r.{name}", call)
    rows = []
    for value in values:
        literals = _split(value) if len(columns) > 1 else [value]
        assert len(literals) == len(columns), value
        rows.append(
            "("
            + ", ".join(
                f"({lit})::{kind}" for lit, (_, kind) in zip(literals, columns, strict=True)
            )
            + ")"
        )
    compared = await conn.fetch(
        f"SELECT r::text AS value, ({old}) AS before, ({call}) AS after "
        f"FROM (VALUES {', '.join(rows)}) AS r({', '.join(name for name, _ in columns)})"
    )
    assert len(compared) == len(values)
    assert [r["before"] for r in compared] == [r["after"] for r in compared], [
        (r["value"][:80], r["before"], r["after"]) for r in compared if r["before"] != r["after"]
    ]
    assert {r["before"] for r in compared} >= {True, False}, f"{constraint}: values too tame"


async def test_a_callers_search_path_cannot_change_a_rule(checks_dsn: str) -> None:
    """A session that puts its own schema before pg_catalog, with a `~` that accepts
    every text, still has a bad queue name and a bad tag refused by name: the functions
    name pg_catalog's operators, not whatever the caller's search_path finds first."""
    owner = await db.connect(checks_dsn)
    try:
        await owner.execute(
            """
            DROP SCHEMA IF EXISTS hostile CASCADE;
            CREATE SCHEMA hostile;
            CREATE FUNCTION hostile.anything(text, text) RETURNS boolean
                LANGUAGE sql IMMUTABLE AS 'SELECT true';
            CREATE OPERATOR hostile.~ (LEFTARG = text, RIGHTARG = text,
                                       FUNCTION = hostile.anything);
            """
        )
        session = await db.connect(checks_dsn)
        try:
            await session.execute("SET search_path = hostile, pg_catalog, duetime")
            assert await session.fetchval("SELECT 'bad queue' ~ 'x'") is True  # it is live
            with pytest.raises(asyncpg.CheckViolationError) as info:
                await session.execute(
                    "INSERT INTO duetime.jobs (task, queue) VALUES ('t', 'bad queue')"
                )
            assert info.value.constraint_name == "jobs_queue_name_invalid"
            with pytest.raises(asyncpg.CheckViolationError) as info:
                await session.execute(
                    "INSERT INTO duetime.jobs (task, tags) VALUES ('t', '{\"a b\"}')"
                )
            assert info.value.constraint_name == "jobs_tags_invalid"
        finally:
            await session.close()
    finally:
        await owner.execute("DROP SCHEMA IF EXISTS hostile CASCADE")
        await owner.close()


async def test_the_functions_are_plain_and_cached(conn: asyncpg.Connection) -> None:
    """What makes them cheap and safe to call from any role's statement: PL/pgSQL (its
    expression is prepared once per connection; a SQL function would be inlined and
    prepared per statement again), no SET clause (a GUC swap on every call), not
    SECURITY DEFINER (they read nothing but their arguments), and never VOLATILE (a
    volatile PL/pgSQL function takes a new snapshot per call)."""
    rows = await conn.fetch(
        "SELECT p.proname, l.lanname, p.proconfig, p.prosecdef, p.provolatile "
        "FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
        "WHERE p.pronamespace = 'duetime'::regnamespace "
        "AND (p.proname LIKE 'when\\_%' OR p.oid IN (SELECT d.refobjid FROM pg_depend d "
        "JOIN pg_constraint c ON d.classid = 'pg_constraint'::regclass AND d.objid = c.oid "
        "WHERE c.conrelid = 'duetime.jobs'::regclass "
        "AND d.refclassid = 'pg_proc'::regclass))"
    )
    assert sorted(r["proname"] for r in rows) == sorted(
        {"check_json_object_size"}
        | {f"check_{n}" for n in _FUNCTIONS}
        | {f"when_{n}" for n in _WHEN}
    )
    for row in rows:
        assert row["lanname"] == "plpgsql", row["proname"]
        assert row["proconfig"] is None, row["proname"]
        assert row["prosecdef"] is False, row["proname"]
        assert row["provolatile"] in (b"i", b"s"), row["proname"]


_STATUSES = (
    "(VALUES ('pending'), ('dispatched'), ('succeeded'), ('dead'), ('cancelled'), ('waiting'))"
)

#: trigger -> (the WHEN it held before 0029, over `o` (OLD) and `n` (NEW); the function
#: call it holds now, over the same; the grid of rows both are compared on)
TRIGGERS: dict[str, tuple[str, str, str]] = {
    "jobs_dispatch_fenced": (
        "n.status = 'dispatched' AND (o.status <> 'dispatched'"
        " OR n.epoch IS DISTINCT FROM o.epoch OR n.at IS DISTINCT FROM o.at)",
        "duetime.when_dispatch_fenced(n.status, o.status, n.epoch, o.epoch, n.at, o.at)",
        f"(SELECT s.column1 AS status, e.e AS epoch, a.a AS at FROM {_STATUSES} s,"
        " (VALUES (NULL::bigint), (1), (2)) e(e),"
        " (VALUES (NULL::timestamptz), ('2026-12-04 00:00Z'), ('2026-12-04 00:01Z')) a(a))",
    ),
    "jobs_unique_release": (
        "n.unique_key IS NOT NULL AND o.status IN ('pending', 'dispatched')"
        " AND n.status NOT IN ('pending', 'dispatched')",
        "duetime.when_unique_release(n.unique_key, o.status, n.status)",
        f"(SELECT s.column1 AS status, k.k AS unique_key FROM {_STATUSES} s,"
        " (VALUES (NULL::text), ('k')) k(k))",
    ),
    "jobs_unique_revive": (
        "n.unique_key IS NOT NULL AND o.status NOT IN ('pending', 'dispatched')"
        " AND n.status IN ('pending', 'dispatched')",
        "duetime.when_unique_revive(n.unique_key, o.status, n.status)",
        f"(SELECT s.column1 AS status, k.k AS unique_key FROM {_STATUSES} s,"
        " (VALUES (NULL::text), ('k')) k(k))",
    ),
    "jobs_unique_key_fixed": (
        "o.unique_key IS DISTINCT FROM n.unique_key OR (o.unique_key IS NOT NULL"
        " AND (o.queue IS DISTINCT FROM n.queue OR o.created_by IS DISTINCT FROM n.created_by))",
        "duetime.when_unique_key_fixed(o.unique_key, n.unique_key, o.queue, n.queue,"
        " o.created_by, n.created_by)",
        "(SELECT k.k AS unique_key, q.q AS queue, b.b AS created_by"
        " FROM (VALUES (NULL::text), ('a'), ('b')) k(k), (VALUES ('q'), ('r')) q(q),"
        " (VALUES (NULL::text), ('u'), ('v')) b(b))",
    ),
    "jobs_release_dependents": (
        "(n.has_dependents OR o.status = 'waiting')"
        " AND o.status IN ('pending', 'dispatched', 'waiting')"
        " AND n.status IN ('succeeded', 'dead', 'cancelled')",
        "duetime.when_release_dependents(n.has_dependents, o.status, n.status)",
        f"(SELECT s.column1 AS status, h.h AS has_dependents FROM {_STATUSES} s,"
        " (VALUES (true), (false)) h(h))",
    ),
    "jobs_notify_finished": (
        "o.status IN ('pending', 'dispatched', 'waiting')"
        " AND n.status IN ('succeeded', 'dead', 'cancelled')",
        "duetime.when_finished(o.status, n.status)",
        f"(SELECT s.column1 AS status FROM {_STATUSES} s)",
    ),
}


@pytest.mark.parametrize("trigger", sorted(TRIGGERS))
async def test_each_trigger_fires_when_it_fired(conn: asyncpg.Connection, trigger: str) -> None:
    """Every (OLD, NEW) pair of the grid: the trigger's WHEN is the function call, and
    the call agrees with the condition it replaced. The fence keeps firing at commit."""
    old, new, grid = TRIGGERS[trigger]
    row = await conn.fetchrow(
        "SELECT pg_get_triggerdef(oid) AS definition, tgdeferrable, tginitdeferred "
        "FROM pg_trigger WHERE tgrelid = 'duetime.jobs'::regclass AND tgname = $1",
        trigger,
    )
    assert row is not None, trigger
    assert f"WHEN ({new.split('(')[0]}(" in row["definition"], row["definition"]
    deferred = trigger == "jobs_dispatch_fenced"
    assert (row["tgdeferrable"], row["tginitdeferred"]) == (deferred, deferred)
    compared = await conn.fetch(
        f"SELECT o::text AS was, n::text AS now, ({old}) AS before, ({new}) AS after "
        f"FROM {grid} o, {grid} n"
    )
    assert len(compared) >= 36
    assert [r["before"] for r in compared] == [r["after"] for r in compared], [
        (r["was"], r["now"], r["before"], r["after"]) for r in compared if r["before"] != r["after"]
    ][:5]
    assert {r["before"] for r in compared} >= {True, False}


async def test_migration_0029_rewrites_no_bucket_and_keeps_rows_working(fresh_dsn: str) -> None:
    """On a table that holds jobs: no bucket is rewritten, every existing row still
    reads the same, a row from before the migration still goes the whole way
    (dispatched, succeeded with its ledger row), and a bad row is still refused."""
    conn = await db.connect(fresh_dsn)
    try:
        for version, _, sql in migrations():
            if version < 29:
                async with conn.transaction():
                    await conn.execute(sql)
        await conn.execute(
            "INSERT INTO duetime.jobs (task, payload, queue, idempotency_key, tags, meta,"
            " traceparent, timeout_s) SELECT 't.old', jsonb_build_object('n', g), 'default',"
            " 'k' || g, '{a,b}', '{\"m\": 1}',"
            " '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01', 30"
            " FROM generate_series(1, 50) g"
        )
        files = (
            "SELECT c.relname, c.relfilenode FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'duetime.jobs'::regclass ORDER BY 1"
        )
        rows = "SELECT * FROM duetime.jobs ORDER BY id"
        before_files = [tuple(r) for r in await conn.fetch(files)]
        before_rows = [dict(r) for r in await conn.fetch(rows)]
        [sql] = [sql for version, _, sql in migrations() if version == 29]
        async with conn.transaction():
            await conn.execute(sql)
        assert [tuple(r) for r in await conn.fetch(files)] == before_files
        assert [dict(r) for r in await conn.fetch(rows)] == before_rows

        job_id, due_at = await conn.fetchrow(
            "SELECT id, due_at FROM duetime.jobs ORDER BY id LIMIT 1"
        )
        epoch = await conn.fetchval("SELECT epoch FROM duetime.leader_fence WHERE shard = 0")
        await conn.execute(
            "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(),"
            " dispatch_epoch = $3 WHERE id = $1 AND due_at = $2",
            job_id,
            due_at,
            epoch,
        )
        async with conn.transaction():
            await conn.execute(
                "SELECT duetime.finish_attempt($1, $2, 1, 'w', NULL)", job_id, due_at
            )
        assert await conn.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job_id) == (
            "succeeded"
        )
        assert (
            await conn.fetchval("SELECT count(*) FROM duetime.job_ledger WHERE job_id = $1", job_id)
            == 1
        )
        with pytest.raises(asyncpg.CheckViolationError) as info:
            await conn.execute("UPDATE duetime.jobs SET tags = '{\"a b\"}' WHERE id = $1", job_id)
        assert info.value.constraint_name == "jobs_tags_invalid"
    finally:
        await conn.close()
