"""What every store holds: a connection type, and the pool it borrows connections from.

``Conn`` is a connection as callers pass it (their own, or one borrowed from a pool).
``Pooled`` is a store's pool with the longest wait for one of its connections (a full
pool raises ``TimeoutError`` instead of queueing forever; callers pass
``Settings.db_timeout``), and ``conn()``, which lets a method join the caller's
transaction when it is given a connection and borrow one otherwise. ``local_setting`` scopes a
planner setting to a few statements of the caller's transaction. ``PooledStore`` is
the constructor of the stores that borrow from a pool (it builds their ``Pooled`` as
``self._db``): the only thing they share, so the only thing they inherit.
Connections themselves (codecs, timeouts, session settings) are made by ``scheduler.db``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeAlias

import asyncpg

from scheduler.config import DEFAULT_DB_TIMEOUT

if TYPE_CHECKING:
    from asyncpg.pool import PoolAcquireContext, PoolConnectionProxy

#: A connection as callers hold it: plain, or the pool's proxy.
Conn: TypeAlias = "asyncpg.Connection[Any] | PoolConnectionProxy[Any]"


def checked_acquire_timeout(seconds: float) -> float:
    """``seconds`` if it can bound a wait for a connection (> 0), else ``ValueError``."""
    if not seconds > 0:
        raise ValueError(f"acquire_timeout must be > 0 (got {seconds!r})")
    return seconds


@asynccontextmanager
async def local_setting(conn: Conn, setting: str, default: str) -> AsyncIterator[None]:
    """The statements inside run under ``setting`` (a ``SET LOCAL`` of the caller's
    transaction), the ones after under the session's choice again (``default``, its
    ``SET LOCAL ... TO DEFAULT``). When a statement inside raises, the setting holds for
    the rest of the transaction, as SET LOCAL does: an error of the server aborts it
    anyway, and a caller that goes on after a client-side error sets it again."""
    await conn.execute(setting)
    yield
    await conn.execute(default)


class Pooled:
    """A store's pool and its ``acquire_timeout`` (module docstring)."""

    __slots__ = ("pool", "timeout")

    def __init__(self, pool: asyncpg.Pool, *, acquire_timeout: float = DEFAULT_DB_TIMEOUT) -> None:
        self.pool = pool
        self.timeout = checked_acquire_timeout(acquire_timeout)

    def acquire(self) -> PoolAcquireContext:
        """A connection from the pool, waiting at most ``timeout`` for it."""
        return self.pool.acquire(timeout=self.timeout)

    @asynccontextmanager
    async def conn(self, conn: Conn | None) -> AsyncIterator[Conn]:
        """``conn`` itself when given (the caller's transaction), else a pooled one."""
        if conn is not None:
            yield conn
        else:
            async with self.acquire() as acquired:
                yield acquired


class PooledStore:
    """A store over ``pool``, holding its ``Pooled`` as ``_db`` (module docstring)."""

    def __init__(self, pool: asyncpg.Pool, *, acquire_timeout: float = DEFAULT_DB_TIMEOUT) -> None:
        """``acquire_timeout``: see ``Pooled``."""
        self._db = Pooled(pool, acquire_timeout=acquire_timeout)
