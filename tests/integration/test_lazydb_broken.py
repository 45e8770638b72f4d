"""``ctx.db`` whose connection dies under the attempt (a primary crash or switchover).

When the server closes a checked-out connection, asyncpg releases it to its pool by
itself and detaches the proxy the attempt holds: every later call on that proxy raises
``InterfaceError``. ``LazyTransaction.close()`` must still return quietly (the server
has aborted the transaction), so the executor records the attempt's real outcome
instead of a ``delivery_failed`` for an error of its own making, and the pool must hand
out working connections afterwards.
"""

from __future__ import annotations

import asyncpg
import pytest

from scheduler import db
from tests.support.wait import wait_for
from workers.errors import CONNECTION_ERRORS
from workers.lazydb import LazyTransaction

pytestmark = pytest.mark.timeout(30)


async def test_close_after_the_server_ended_the_connection(dsn: str) -> None:
    pool = await db.create_pool(dsn, min_size=1, max_size=2, timeout=5)
    try:
        tx = LazyTransaction(pool, timeout=5)
        backend = await tx.fetchval("SELECT pg_backend_pid()")
        conn = await tx.connection()
        killer = await asyncpg.connect(dsn, timeout=5)
        try:
            assert await killer.fetchval("SELECT pg_terminate_backend($1)", backend)
        finally:
            await killer.close()

        with pytest.raises(CONNECTION_ERRORS):  # the statement meets the closed connection
            await tx.execute("SELECT 1")

        def released() -> bool:  # asyncpg detached the proxy from its connection
            try:
                conn.is_closed()
            except asyncpg.InterfaceError:
                return True
            return False

        await wait_for(released, timeout=5, message="asyncpg released the dead connection")
        await tx.close()
        await tx.close()  # safe twice
        assert await pool.fetchval("SELECT pg_backend_pid() <> $1::int", backend)
    finally:
        await pool.close()
