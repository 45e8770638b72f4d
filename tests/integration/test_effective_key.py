"""A job's effective idempotency key has one rule written twice: in Python
(``scheduler.messages.effective_key``: the ledger key of the client API, the dashboard and
the testing helpers) and in SQL, inside ``begin_deliveries`` (scheduler/sql/execution.sql),
where the worker needs it in the statement that locks the row. The two must agree."""

from __future__ import annotations

import asyncpg
import pytest

from scheduler.messages import effective_key
from scheduler.sql import load
from scheduler.store.execution import ExecutionStore
from scheduler.store.rows import JobRef
from tests.fixtures_tasks.jobs import dispatched_job

#: The expression begin_deliveries computes the key with, as written there.
EXPRESSION = "coalesce(nullif(idempotency_key, ''), 'job:' || id)"


def test_the_worker_statement_computes_the_key_with_this_expression() -> None:
    assert EXPRESSION in load("execution")["begin_deliveries"]


@pytest.mark.parametrize("key", [None, "", "report:2031-07-01"])
async def test_the_sql_expression_and_the_python_function_agree(
    db_pool: asyncpg.Pool, key: str | None
) -> None:
    """NULL and the empty string both mean "no key" (the table refuses '', but a row can
    only be trusted so far: the rule must not depend on it)."""
    sql = f"SELECT {EXPRESSION} FROM (VALUES ($1::text, $2::bigint)) AS j(idempotency_key, id)"
    assert await db_pool.fetchval(sql, key, 42) == effective_key(42, key)


@pytest.mark.parametrize("key", [None, "report:2031-07-01"])
async def test_begin_reads_the_key_that_python_computes(
    db_pool: asyncpg.Pool, unique: str, key: str | None
) -> None:
    job = await dispatched_job(db_pool, "t.key", queue=f"q-{unique}", idempotency_key=key)
    [locked] = await ExecutionStore(db_pool).begin([JobRef(job.id, job.due_at, 1)])
    assert locked is not None
    assert locked.key == effective_key(job.id, key)
