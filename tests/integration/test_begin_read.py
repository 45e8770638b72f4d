"""The worker's begin read (``begin_deliveries``: ``duetime.worker_begin_flow``) answers
``done`` from the ledger by one primary-key lookup per delivery, whatever the ledger held
when its plan was made (migration 0030).

The plan of that statement is made once per session. Before 0030, a session that made
it while the ledger was small (a new install, a worker started before a storm) kept a
hashed subplan: every begin read then read the whole ledger into a hash, 0.32 ms of
PostgreSQL CPU per delivery once it held 20,000 rows against 0.035 ms
(docs/benchmarks.md, "The begin read and the ledger it looked up")."""

from __future__ import annotations

import asyncpg
import pytest

from scheduler import db
from scheduler.sql import load

BEGIN = load("execution")["begin_deliveries"]
RELEASE = load("execution")["release_guards"]
#: what the worker's store pool sets on its sessions (workers/shards.py)
STORE_SESSION = {"plan_cache_mode": "force_generic_plan"}


async def _dispatched(conn: asyncpg.Connection, n: int) -> tuple[list[int], list[object], int]:
    rows = await conn.fetch(
        "INSERT INTO duetime.jobs (task, payload, queue) "
        "SELECT 't.begin', '{}', 'default' FROM generate_series(1, $1) RETURNING id, due_at",
        n,
    )
    epoch = await conn.fetchval("SELECT epoch FROM duetime.leader_fence WHERE shard = 0")
    await conn.execute(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(),"
        " dispatch_epoch = $2 WHERE id = ANY($1)",
        [r["id"] for r in rows],
        epoch,
    )
    return [r["id"] for r in rows], [r["due_at"] for r in rows], epoch


@pytest.mark.parametrize("session", [STORE_SESSION, None], ids=["store-pool", "pooler"])
async def test_the_begin_read_looks_each_key_up_however_the_ledger_grew(
    migrated_dsn: str, session: dict[str, str] | None
) -> None:
    """The session's first begin read makes its plan while the ledger is empty; 2,001
    ledger rows arrive after it. The next begin read still answers ``done`` per job
    (true for the job whose key the ledger holds) and reads the ledger through its
    primary key only: no scan of the ledger, which grows with every job run."""
    conn = await db.connect(migrated_dsn, server_settings=session)
    try:
        ids, dues, epoch = await _dispatched(conn, 2)
        args = (ids, dues, [1, 1], [epoch, epoch], [], [], [])
        first = await conn.fetch(BEGIN, *args)  # the plan is made now
        assert [r["done"] for r in sorted(first, key=lambda r: r["i"])] == [False, False]
        await conn.execute("SELECT pg_advisory_unlock_all()")
        await conn.execute(
            "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker)"
            " SELECT 'key:' || g || ':other:k', 1000000 + g, 1, 't.other', 'w'"
            " FROM generate_series(1, 2000) g"
        )
        await conn.execute(
            "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker)"
            " VALUES ('job:' || $1::bigint, $1, 1, 't.begin', 'w')",
            ids[0],
        )
        async with conn.transaction():
            rows = await conn.fetch(BEGIN, *args)
            ledger = await conn.fetchrow(
                "SELECT seq_scan, coalesce(idx_scan, 0) AS idx_scan FROM pg_stat_xact_user_tables"
                " WHERE relid = 'duetime.job_ledger'::regclass"
            )
        assert [r["done"] for r in sorted(rows, key=lambda r: r["i"])] == [True, False]
        assert ledger is not None
        assert ledger["seq_scan"] == 0, "the begin read scanned the whole ledger"
        assert ledger["idx_scan"] >= 2  # the primary key, looked up for each delivery
    finally:
        await conn.close()


async def test_the_begin_function_keeps_one_plan_per_session_itself(migrated_dsn: str) -> None:
    """Through a transaction pooler the store pool cannot set ``plan_cache_mode``; the
    function carries it, so its plan is made once per server session, not at every
    call (about 1 ms for 8 deliveries over 17 buckets)."""
    conn = await db.connect(migrated_dsn)
    try:
        config = await conn.fetchval(
            "SELECT proconfig FROM pg_proc WHERE oid = 'duetime.worker_begin_flow("
            "bigint[], timestamptz[], integer[], bigint[], bigint[], integer[], bigint[])'"
            "::regprocedure"
        )
    finally:
        await conn.close()
    assert "plan_cache_mode=force_generic_plan" in config
    assert "search_path=pg_catalog, pg_temp" in config


async def test_the_release_of_guards_keeps_its_plan_and_releases_what_it_holds(
    migrated_dsn: str,
) -> None:
    """duetime.worker_release (released guards ride along with nearly every begin read)
    is PL/pgSQL since migration 0032: its statement is planned once per session, where
    as a SQL function with SET clauses it was parsed and planned at every call (0.1 ms).
    It still releases the guards this session holds, counts them, and says nothing to
    the client about a guard it does not hold."""
    conn = await db.connect(migrated_dsn, server_settings=STORE_SESSION)
    notices: list[object] = []
    conn.add_log_listener(lambda _conn, message: notices.append(message))
    held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    try:
        ids, dues, epoch = await _dispatched(conn, 3)
        started = await conn.fetch(BEGIN, ids, dues, [1, 1, 1], [epoch] * 3, [], [], [])
        assert [r["started"] for r in started] == [True, True, True]
        assert await conn.fetchval(held) == 3
        assert await conn.fetchval(RELEASE, ids, [1, 1, 1], [epoch] * 3) == 3
        assert await conn.fetchval(held) == 0
        assert await conn.fetchval(RELEASE, ids, [1, 1, 1], [epoch] * 3) == 0
        assert notices == []
        language, config = await conn.fetchrow(
            "SELECT l.lanname, p.proconfig FROM pg_proc p"
            " JOIN pg_language l ON l.oid = p.prolang"
            " WHERE p.oid = 'duetime.worker_release(bigint[], integer[], bigint[])'::regprocedure"
        )
    finally:
        await conn.close()
    assert language == "plpgsql"
    assert "plan_cache_mode=force_generic_plan" in config
    assert "client_min_messages=error" in config
