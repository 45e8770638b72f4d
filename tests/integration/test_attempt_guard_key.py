"""The attempt guard's lock key (migration 0012, made inlinable by 0020) against real
PostgreSQL: it is the same key for every attempt as before, and PostgreSQL inlines it
into its callers instead of calling it per row through the function manager."""

from __future__ import annotations

import json

import asyncpg
import pytest

pytestmark = pytest.mark.timeout(30)

GUARD = "duetime.attempt_guard(bigint, integer, bigint)"


@pytest.mark.parametrize(
    ("job_id", "attempt", "epoch", "text"),
    [(42, 3, 7, "42:3:7"), (9_000_000_000, 1, None, "9000000000:1:"), (1, 20, 0, "1:20:0")],
)
async def test_the_guard_key_is_the_one_running_workers_lock(
    db_pool: asyncpg.Pool, job_id: int, attempt: int, epoch: int | None, text: str
) -> None:
    """Workers of the previous version hold their guards under the 0012 key: a changed
    key would let a copy of one of their running attempts run here during an upgrade."""
    expected = await db_pool.fetchval("SELECT hashtextextended($1, 20261203)", text)
    key = await db_pool.fetchval("SELECT duetime.attempt_guard($1, $2, $3)", job_id, attempt, epoch)
    assert key == expected


async def test_the_guard_key_is_inlined_into_its_callers(db_pool: asyncpg.Pool) -> None:
    """A SET clause keeps a SQL function from being inlined (12.7 µs a call instead of
    0.5 µs, three calls per delivery): the function has none, and a plan that uses it
    shows the hash itself."""
    config = await db_pool.fetchval(
        f"SELECT proconfig FROM pg_proc WHERE oid = '{GUARD}'::regprocedure"
    )
    assert config is None
    plan = await db_pool.fetchval(
        "EXPLAIN (VERBOSE, FORMAT JSON) "
        "SELECT duetime.attempt_guard(g, 1, 2) FROM generate_series(1, 3) g"
    )
    text = json.dumps(plan) if not isinstance(plan, str) else plan
    assert "hashtextextended" in text and "attempt_guard" not in text


async def test_the_inlined_key_cannot_be_redirected_by_the_search_path(
    db_pool: asyncpg.Pool,
) -> None:
    """What the SET clause guarded against: an operator or function of the caller's
    search_path taking the place of the one meant. Every name in the body is
    pg_catalog's, so a hostile ``||`` in an earlier schema changes nothing."""
    expected = await db_pool.fetchval("SELECT hashtextextended('5:1:2', 20261203)")
    async with db_pool.acquire() as conn:
        rollback = conn.transaction()
        await rollback.start()
        try:
            await conn.execute(
                "CREATE SCHEMA hostile; "
                "CREATE FUNCTION hostile.cat(text, text) RETURNS text LANGUAGE sql "
                "AS $$ SELECT 'x' $$; "
                "CREATE OPERATOR hostile.|| (LEFTARG = text, RIGHTARG = text, "
                "FUNCTION = hostile.cat); "
                "CREATE FUNCTION hostile.hashtextextended(text, bigint) RETURNS bigint "
                "LANGUAGE sql AS $$ SELECT 0::bigint $$; "
                "SET LOCAL search_path = hostile, pg_catalog"
            )
            assert await conn.fetchval("SELECT 'a' || 'b'") == "x"  # the trap is armed
            assert await conn.fetchval("SELECT duetime.attempt_guard(5, 1, 2)") == expected
        finally:
            await rollback.rollback()  # the schema and the search_path with it
