"""``ctx.db`` whose connection dies under the attempt (a primary crash or switchover).

When the server closes a checked-out connection, asyncpg releases it to its pool by
itself and detaches the proxy the attempt holds: every later call on that proxy raises
``InterfaceError``. ``LazyTransaction.close()`` must still return quietly (the server
has aborted the transaction), so the executor records the attempt's real outcome
instead of a ``delivery_failed`` for an error of its own making, and the pool must hand
out working connections afterwards.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from scheduler import db
from workers.errors import CONNECTION_ERRORS
from workers.lazydb import LazyTransaction

pytestmark = pytest.mark.timeout(30)


async def test_close_after_the_server_ended_the_connection(dsn: str) -> None:
    pool = await db.create_pool(dsn, min_size=1, max_size=2, timeout=5)
    try:
        tx = LazyTransaction(pool, timeout=5)
        backend = await tx.fetchval("SELECT pg_backend_pid()")
        killer = await asyncpg.connect(dsn, timeout=5)
        try:
            assert await killer.fetchval("SELECT pg_terminate_backend($1)", backend)
        finally:
            await killer.close()

        # The statement meets the closed connection. Usually asyncpg has released it
        # already (InterfaceError: the proxy is detached, the case close() must survive);
        # sometimes it is still processing the server's goodbye (InternalClientError) and
        # the proxy is still attached. close() must be quiet either way.
        with pytest.raises(CONNECTION_ERRORS):
            await tx.execute("SELECT 1")
        await asyncio.wait_for(tx.close(), 5)
        await asyncio.wait_for(tx.close(), 5)  # safe twice
        assert await pool.fetchval("SELECT pg_backend_pid() <> $1::int", backend)
    finally:
        try:
            await asyncio.wait_for(pool.close(), 5)
        except TimeoutError:  # a connection still checked out: fail the test, not hang
            pool.terminate()
            raise
