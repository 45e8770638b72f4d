"""``ctx.db``: the attempt's transaction, opened on first use.

Most handlers of a storm never touch the database (they call an API, send a mail); the
ones that do need their writes to commit with the ledger row. So ``ctx.db`` is a
``LazyTransaction``: nothing is acquired until the handler's first statement, which
takes a pooled connection and opens the transaction. The executor then finishes the
attempt inside that same transaction (``duetime.finish_attempt``: job ``succeeded`` +
ledger row) and commits, so those effects are applied exactly once; an attempt that never
used it is settled in a batch with others (``workers.settlement``), one statement for many.

The common ``asyncpg.Connection`` calls are here (``execute``, ``fetch*``,
``executemany``, ``copy_*``, ``prepare``, ``transaction()`` for a savepoint). Anything
else: ``conn = await ctx.db.connection()`` returns the connection itself (already inside
the transaction). Never commit or roll back the outer transaction yourself.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Any

import asyncpg

from scheduler.store.conn import Conn
from scheduler.store.rows import Completion
from workers.groups import Groups, Member


class StatementTimeout(TimeoutError):
    """A ``ctx.db`` statement ran past the ``timeout=`` its caller gave it. Statements
    given none are bounded by the task's timeout, which the executor reports as such."""


class LazyTransaction:
    __slots__ = ("_completion", "_conn", "_groups", "_lock", "_pool", "_timeout", "_tx", "member")

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        timeout: float,
        groups: Groups | None = None,
        completion: Completion | None = None,
    ) -> None:
        self._pool = pool
        self._timeout = timeout
        self._groups = groups if completion is not None else None
        self._completion = completion
        self._conn: Conn | None = None
        self._tx: Any = None
        self._lock = asyncio.Lock()
        self.member: Member | None = None  # set when the attempt joined a group

    @property
    def opened(self) -> bool:
        """True once the handler used the database (a transaction is open)."""
        return self._conn is not None or self.member is not None

    def _joined(self) -> Member | None:
        if self.member is None and self._conn is None and self._groups is not None:
            assert self._completion is not None
            self.member = self._groups.join(self._completion)
        return self.member

    async def connection(self) -> Conn:
        """The pooled connection, inside the attempt's transaction (opened now if needed).
        In a transaction group this holds the group's connection for the rest of the
        attempt (``workers.groups``)."""
        member = self._joined()
        if member is not None:
            return await member.connection()
        if self._conn is not None:
            return self._conn
        async with self._lock:
            if self._conn is None:
                conn = await self._pool.acquire(timeout=self._timeout)
                try:
                    tx = conn.transaction()
                    async with asyncio.timeout(self._timeout * 3):
                        await tx.start()
                except BaseException:
                    await self._pool.release(conn)
                    raise
                self._conn, self._tx = conn, tx
        return self._conn

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            member = self._joined()
            if member is not None:
                return await member.call(method, *args, **kwargs)
            return await getattr(await self.connection(), method)(*args, **kwargs)
        except TimeoutError as exc:
            given = kwargs.get("timeout")
            if given is None:  # the task's own timeout: the executor says so
                raise
            raise StatementTimeout(
                f"ctx.db.{method}: the statement exceeded the timeout={given:g}s given to it"
            ) from exc

    # -- the Connection calls handlers use -----------------------------------------

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> str:
        return str(await self._call("execute", query, *args, timeout=timeout))

    async def executemany(self, command: str, args: Any, *, timeout: float | None = None) -> None:
        await self._call("executemany", command, args, timeout=timeout)

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> list[Any]:
        return list(await self._call("fetch", query, *args, **kwargs))

    async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._call("fetchrow", query, *args, **kwargs)

    async def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return await self._call("fetchval", query, *args, **kwargs)

    async def copy_records_to_table(self, table_name: str, **kwargs: Any) -> str:
        return str(await self._call("copy_records_to_table", table_name, **kwargs))

    async def copy_to_table(self, table_name: str, **kwargs: Any) -> str:
        return str(await self._call("copy_to_table", table_name, **kwargs))

    async def copy_from_query(self, query: str, *args: Any, **kwargs: Any) -> str:
        return str(await self._call("copy_from_query", query, *args, **kwargs))

    async def copy_from_table(self, table_name: str, **kwargs: Any) -> str:
        return str(await self._call("copy_from_table", table_name, **kwargs))

    async def prepare(self, query: str, **kwargs: Any) -> Any:
        # a prepared statement outlives one call: in a group it needs the connection held
        return await (await self.connection()).prepare(query, **kwargs)

    def transaction(self, **kwargs: Any) -> Any:
        """``async with ctx.db.transaction():`` — a savepoint inside the attempt's
        transaction (asyncpg nests it on the open transaction)."""
        member = self._joined()
        if member is not None:
            return member.savepoint(**kwargs)
        return _Savepoint(self, kwargs)

    def __getattr__(self, name: str) -> Any:
        conn = object.__getattribute__(self, "_conn")
        if conn is not None:
            return getattr(conn, name)
        raise AttributeError(
            f"ctx.db.{name}: open the connection first with `conn = await ctx.db.connection()`"
        )

    # -- the executor's side ---------------------------------------------------------

    async def commit(self, last: str | None = None) -> None:
        """COMMIT; with ``last`` (a statement as text, no parameters), run it and COMMIT in
        one round trip (simple query protocol). An error in ``last`` aborts the
        transaction and skips the COMMIT: the transaction stays open, aborted, for
        ``close()`` to roll back. Bounded at 3 x the acquire timeout (the worker's own
        statement; the pool leaves handlers' statements to their task's timeout)."""
        conn, tx = self._conn, self._tx
        assert conn is not None and tx is not None
        if last is None:
            async with asyncio.timeout(self._timeout * 3):
                await tx.commit()
            return
        try:
            await conn.execute(f"{last.rstrip().rstrip(';')};\nCOMMIT", timeout=self._timeout * 3)
        finally:
            if not conn.is_in_transaction():  # committed, or the COMMIT itself failed
                _ended_outside(tx)

    async def close(self) -> None:
        """Roll back what is still open and give the connection back; safe twice. If the
        rollback is impossible (connection broken, a query still cancelling), drop the
        connection: the server then aborts the transaction itself. A connection the
        server closed (a primary crash, a switchover) was already released by asyncpg,
        which detaches our proxy: every call on it raises ``InterfaceError``, and there
        is nothing left to roll back or drop. A group member that never reported
        (cancelled) is reported as failed, so its group can finish."""
        if self.member is not None and not self.member.reported:
            self.member.mark(asyncio.CancelledError())
        conn, tx = self._conn, self._tx
        self._conn = self._tx = None
        if conn is None:
            return
        try:
            if conn.is_in_transaction():
                async with asyncio.timeout(self._timeout):
                    await tx.rollback()
        except Exception:
            with contextlib.suppress(asyncpg.InterfaceError):  # released by asyncpg
                if not conn.is_closed() and conn.is_in_transaction():
                    conn.terminate()
        finally:
            await self._pool.release(conn)  # type: ignore[arg-type]


def _ended_outside(tx: Any) -> None:
    """Tell asyncpg that the transaction ``tx`` started has ended by a COMMIT it did not
    send itself (``LazyTransaction.commit``): otherwise the pooled connection would think
    it is still inside it, and its next user's ``transaction()`` would open a savepoint
    outside any transaction. asyncpg (0.29-0.32) keeps this state in ``Transaction._state``
    and ``Connection._top_xact``; tests/integration/test_isolation.py checks that a
    connection so committed serves the next attempt's transaction normally."""
    from asyncpg.transaction import TransactionState

    tx._state = TransactionState.COMMITTED
    if tx._connection._top_xact is tx:
        tx._connection._top_xact = None


class _Savepoint:
    __slots__ = ("_inner", "_kwargs", "_owner")

    def __init__(self, owner: LazyTransaction, kwargs: dict[str, Any]) -> None:
        self._owner = owner
        self._kwargs = kwargs
        self._inner: Any = None

    async def __aenter__(self) -> _Savepoint:
        conn = await self._owner.connection()
        self._inner = conn.transaction(**self._kwargs)
        await self._inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        suppress: bool | None = await self._inner.__aexit__(exc_type, exc, tb)
        return suppress
