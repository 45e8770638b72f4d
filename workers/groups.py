"""Transaction groups: attempts of tasks that opted in (``share_transaction=True``)
and use ``ctx.db`` at the same time share one transaction.

What sharing gives up (why it is an opt-in, DESIGN §15): members see each other's
uncommitted writes, each other's row and advisory locks (``pg_advisory_xact_lock`` does
not keep two members apart: they hold it together) and each other's transaction-local
settings (``SET LOCAL``, ``set_config(..., true)``: a tenant set for row-level security
leaks to the neighbours), and a member's failure runs every other member's handler
again, repeating its external calls. Measured with sharing as the default: 125 of 400
jobs read another job's tenant; 3-7 overlapping runs per burst under an advisory lock.

Why share at all. An attempt in a transaction of its own costs four round trips and one commit
(BEGIN, the handler's statement, ``finish``, COMMIT); on the 2-core development machine
that capped one worker at ~0.3x of the bare pipeline, a third of its time in socket
writes (docs/benchmarks.md). Attempts that run at the same time can share one
transaction instead: one BEGIN, their statements, one ``finish_group`` for all of them,
one COMMIT — the group commit that River's and graphile-worker's batch completers apply
to job state, extended here to the handlers' own writes, which must commit with their
ledger rows.

How (``Groups.join`` is called at a handler's first ``ctx.db`` statement):

- A member joins the open group, or opens one (a pooled connection, then BEGIN).
  Attempts that start together join while that BEGIN is in flight; the group is sealed
  one loop turn after it returned, or when it holds ``max_members``. It never holds two
  attempts with the same idempotency key.
- Members' statements run one at a time on the group's connection (a lock held for one
  statement). Between statements members run concurrently: a handler awaiting I/O holds
  nobody's handler up, it only delays the group's commit.
- A savepoint (``ctx.db.transaction()``) holds the lock for its block; the raw
  connection (``ctx.db.connection()``, ``prepare``) for the rest of the attempt.
- When every member reported: if all succeeded, ``finish_group`` + COMMIT settle them all.
  Otherwise the group rolls back. A member whose handler raised is a failed attempt,
  recorded as usual; **every other member is re-run in a transaction of its own** (its
  writes went with the rollback): a neighbour's failure costs a second run of the
  handler, never an attempt, and effects are still applied exactly once.
- A statement error aborts the transaction: the group is poisoned, and the other
  members' next statements raise ``GroupAborted`` without reaching the server. It is a
  BaseException (like CancelledError), so a handler's ``except Exception`` lets it pass.

Only tasks registered with ``share_transaction=True`` join groups, and not those whose
handlers typically run longer than ``workers.executor.GROUP_MAX_HANDLER_SECONDS``: a
group commits when its slowest member is done, so slow members would hold the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.log import get_logger
from scheduler.store.conn import Conn
from scheduler.store.execution import ExecutionStore
from scheduler.store.rows import Completion
from workers.errors import CONNECTION_ERRORS, DatabaseUnavailable
from workers.verdicts import Verdict

log = get_logger("duetime.worker")

#: Most attempts in one group.
MAX_MEMBERS = 32


class GroupAborted(BaseException):
    """Another member's statement failed: this attempt is re-run on its own."""


@dataclass(eq=False)
class Member:
    group: Group
    completion: Completion
    verdict: asyncio.Future[Verdict]
    failure: BaseException | None = None
    reported: bool = False
    savepoints: int = 0
    raw: bool = False
    #: seconds spent waiting for the group's BEGIN and lock: the group's cost, not the
    #: handler's (``Executor._groupable`` must not mistake it for a slow handler)
    waited: float = 0.0

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one Connection method on the group's connection, under the lock."""
        group = self.group
        clock = group.groups.clock
        queued = clock.monotonic()
        await group.started  # raises when the group could not open its transaction
        if group.owner is self:
            self.waited += clock.monotonic() - queued
            return await group.run(self, method, args, kwargs)
        async with group.lock:
            self.waited += clock.monotonic() - queued
            return await group.run(self, method, args, kwargs)

    async def connection(self) -> Conn:
        """The raw connection, for the rest of this attempt (holds the lock until then)."""
        await self._own()
        self.raw = True
        return self.group.conn_or_abort()

    @contextlib.asynccontextmanager
    async def savepoint(self, **kwargs: Any) -> Any:
        await self._own()
        self.savepoints += 1
        try:
            async with self.group.conn_or_abort().transaction(**kwargs) as tx:
                yield tx
        except BaseException:
            if self.savepoints == 1 and not self.group.conn_or_abort().is_in_transaction():
                self.group.poison(self)
            raise
        finally:
            self.savepoints -= 1
            if self.savepoints == 0 and not self.raw:
                self._disown()

    async def report(self, failure: BaseException | None) -> Verdict:
        """The handler returned (``failure`` None) or raised; wait for the group."""
        self.mark(failure)
        return await self.verdict

    def mark(self, failure: BaseException | None) -> None:
        if self.reported:
            return
        self.reported = True
        self.failure = failure
        if self.group.owner is self:
            self._disown()
        self.group.maybe_complete()

    async def _own(self) -> None:
        await self.group.started
        if self.group.owner is not self:
            await self.group.lock.acquire()
            self.group.owner = self

    def _disown(self) -> None:
        self.group.owner = None
        self.group.lock.release()


@dataclass(eq=False)
class Group:
    groups: Groups
    members: list[Member] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    owner: Member | None = None
    sealed: bool = False
    poisoned: bool = False
    completing: bool = False
    conn: Conn | None = None
    tx: Any = None
    started: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def conn_or_abort(self) -> Conn:
        if self.poisoned or self.conn is None:
            raise GroupAborted()
        return self.conn

    async def run(
        self, member: Member, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        conn = self.conn_or_abort()
        try:
            return await getattr(conn, method)(*args, **kwargs)
        except (asyncpg.PostgresError, asyncio.CancelledError):
            if member.savepoints == 0:  # inside a savepoint its rollback recovers
                self.poison(member)
            raise

    def poison(self, member: Member) -> None:
        if not self.poisoned:
            self.poisoned = True
            log.debug("transaction_group_aborted", members=len(self.members))

    async def start(self) -> None:
        """Acquire a connection and BEGIN; seal one loop turn later."""
        pool, timeout = self.groups.pool, self.groups.timeout
        try:
            conn = await pool.acquire(timeout=timeout)
            try:
                tx = conn.transaction()
                async with asyncio.timeout(timeout * 3):  # the handler pool bounds nothing
                    await tx.start()
            except BaseException:
                await pool.release(conn)
                raise
            self.conn, self.tx = conn, tx
            self.started.set_result(None)
        except BaseException as exc:
            self.started.set_exception(
                exc if not isinstance(exc, asyncio.CancelledError) else GroupAborted()
            )
            self.started.exception()  # retrieved: members see it through join()
            self.seal()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        await asyncio.sleep(0)
        self.seal()

    def seal(self) -> None:
        self.sealed = True
        self.groups.forget(self)
        self.maybe_complete()

    def maybe_complete(self) -> None:
        if self.sealed and not self.completing and all(m.reported for m in self.members):
            self.completing = True
            self.groups.spawn(self.complete(), name="group:complete")

    async def complete(self) -> None:
        try:
            async with asyncio.timeout(self.groups.timeout * 3):  # finish_group + COMMIT
                verdicts = await self._decide()
        except BaseException as exc:
            error = exc
            if isinstance(exc, CONNECTION_ERRORS):
                error = DatabaseUnavailable(f"{type(exc).__name__}: {exc}")
            for member in self.members:
                if not member.verdict.done():
                    if isinstance(exc, asyncio.CancelledError):
                        member.verdict.cancel()
                    else:
                        member.verdict.set_exception(error)
                        member.verdict.exception()
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            for member, verdict in zip(self.members, verdicts, strict=True):
                if not member.verdict.done():
                    member.verdict.set_result(verdict)
        finally:
            await self._release()

    async def _decide(self) -> list[Verdict]:
        if self.conn is None:  # never started: nothing was written
            return [
                Verdict.FAILED if m.failure is not None else Verdict.RERUN for m in self.members
            ]
        if self.poisoned or any(m.failure is not None for m in self.members):
            await self._rollback()
            return [
                Verdict.FAILED
                if m.failure is not None and not isinstance(m.failure, GroupAborted)
                else Verdict.RERUN
                for m in self.members
            ]
        try:
            found = await self.groups.store.finish_group(
                self.conn, [m.completion for m in self.members], self.groups.worker
            )
        except asyncpg.PostgresError:
            await self._rollback()
            return [Verdict.RERUN] * len(self.members)
        if all(f.settled and f.recorded for f in found):
            try:
                await self.tx.commit()
            except asyncpg.PostgresError:  # e.g. a handler's deferred constraint
                await self._rollback()
                return [Verdict.RERUN] * len(self.members)
            return [Verdict.COMMITTED] * len(self.members)
        await self._rollback()
        return [
            Verdict.SUPERSEDED
            if not f.settled
            else Verdict.DUPLICATE
            if not f.recorded
            else Verdict.RERUN
            for f in found
        ]

    async def _rollback(self) -> None:
        conn = self.conn
        if conn is None:
            return
        try:
            if conn.is_in_transaction():
                async with asyncio.timeout(self.groups.timeout):
                    await self.tx.rollback()
        except Exception:
            # A connection the server closed was released by asyncpg, which detached
            # our proxy: every call on it raises InterfaceError (workers/lazydb.py).
            with contextlib.suppress(asyncpg.InterfaceError):
                if not conn.is_closed() and conn.is_in_transaction():
                    conn.terminate()

    async def _release(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                open_tx = conn.is_in_transaction()
            except asyncpg.InterfaceError:  # the server closed it; asyncpg released it
                return
            if open_tx:
                await self._rollback()
            await self.groups.pool.release(conn)  # type: ignore[arg-type]


class Groups:
    """Opens groups as attempts join them; owns their start and completion tasks."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        store: ExecutionStore,
        *,
        worker: str,
        timeout: float,
        max_members: int = MAX_MEMBERS,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.pool = pool
        self.clock = clock
        self.store = store
        self.worker = worker
        self.timeout = timeout
        self.max_members = max_members
        self._open: Group | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.groups = 0  # groups opened (tests, benchmarks)
        self.members = 0

    def join(self, completion: Completion) -> Member:
        group = self._open
        if (
            group is None
            or group.sealed
            or len(group.members) >= self.max_members
            or completion.key in group.keys
        ):
            group = Group(self)
            self._open = group
            self.groups += 1
            self.spawn(group.start(), name="group:start")
        member = Member(group, completion, asyncio.get_running_loop().create_future())
        group.members.append(member)
        group.keys.add(completion.key)
        self.members += 1
        if len(group.members) >= self.max_members:
            self.forget(group)
        return member

    def forget(self, group: Group) -> None:
        if self._open is group:
            self._open = None

    def spawn(self, coro: Any, *, name: str) -> None:
        """Run ``coro`` as a task owned here, outside the spawning delivery's context: a
        group's lines must not carry the job fields bound to one of its members."""
        task = asyncio.create_task(coro, name=name, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("transaction_group_failed", error=repr(task.exception()))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
