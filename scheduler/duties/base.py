"""One shape for every leader duty (dispatcher, planner, reconciler, maintainer, fence
heartbeat), by composition: a duty is a plain object, and what duties share is a few
collaborators it holds, not a base class.

A duty is any object with a ``name`` and ``async run_once() -> float`` (one pass of
work; it returns how long to wait before the next pass), and optionally ``setup()`` /
``teardown()`` (per-term resources: connections, LISTEN). It owns a ``DutyLoop``
(``duty.loop``) that runs it in one owned asyncio task, started by ``start(term)`` and
cancelled by ``stop()``; ``wake()`` cuts the wait short (a NOTIFY arrived, a new job
is due earlier). Contract (after River's startstop):

- ``stop()`` is safe before ``start()`` and safe twice; it awaits the task's cleanup.
- A pass that raises is logged with its traceback and counted (per shard and duty),
  and the loop retries
  after a jittered back-off: a duty never dies silently while the replica still
  claims leadership.
- ``Fenced`` and ``LeadershipLost`` are not retried: they end the task, and the
  replica, which watches ``task``, steps down (a planned stop is told apart from a
  failure by ``stopped_by_request``).

Tests call ``run_once()`` directly after ``loop.bind(term)``; no sleeps needed.

The pieces the fenced duties share, each defined here once:

- ``FencedWrites``: the lease check before a write (fail closed: ``LeadershipLost``
  once the lease can no longer be proven alive, before a doomed round trip, although
  the fence would refuse a stale commit anyway) and the pooled fenced transaction;
- ``DutyPublisher``: the dispatch store, and a publisher of the duty's own (its own AMQP
  connection, named after the duty so RabbitMQ's management view tells them apart)
  unless one is injected, which tests and benchmarks share and close themselves, behind
  a ``BrokerGate``: whether the broker takes messages now (back-pressure, reconnecting);
- ``park_unreadable``: rows the client cannot decode go dead with the reason, so one row
  cannot fail every batch it sorts into;
- ``duty_listener``: the kept LISTEN connection that wakes a duty;
- ``from_context``: a fenced duty built from the replica's ``DutyContext``, which is
  defined here (not in the replica) so that duties never import the replica.

The settings-to-config step is ``scheduler.duties.knobs``. The module is about 400
lines because the contract and every shared piece are in this one place to look.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import asyncpg

from scheduler.backoff import bounded_jitter
from scheduler.clock import Clock
from scheduler.config.shards import DEFAULT_SHARD
from scheduler.errors import Fenced, LeadershipLost
from scheduler.log import get_logger
from scheduler.metrics import DUTY_FAILURES, JOBS_PARKED
from scheduler.publisher import Publisher
from scheduler.store.dispatch import DispatchStore
from scheduler.store.fenced import fenced_transaction
from scheduler.store.listener import KeptListener

if TYPE_CHECKING:
    from scheduler.config import Settings
    from scheduler.store.conn import Conn
    from scheduler.store.fence import FenceStore
    from scheduler.store.rows import UnreadableRow

D_co = TypeVar("D_co", covariant=True)

#: At most this many job ids are written into one log line (the count is always there).
MAX_IDS_LOGGED = 100

#: A failed pass is cheap; lateness is what guarantee 5 promises against.
MAX_BACKOFF = 2.0


@dataclass(frozen=True, slots=True)
class LeaderTerm:
    """What a duty knows about the leadership it runs under."""

    epoch: int
    node_id: str


@dataclass(frozen=True)
class DutyContext:
    """What a duty may use: built once per replica, shared by every duty it runs."""

    settings: Settings
    pool: asyncpg.Pool
    fence: FenceStore
    clock: Clock
    node_id: str
    is_leader: Callable[[], bool]
    """True only inside the lease's trust window; check right before acting (fail closed)."""
    shard: str = DEFAULT_SHARD
    """The shard whose database ``pool`` is: the messages a duty publishes name it."""


class Work(Protocol):
    """What a ``DutyLoop`` runs: ``setup()`` and ``teardown()`` are optional."""

    name: str

    async def run_once(self) -> float: ...


class Duty(Protocol):
    """What the replica runs: a named duty and the loop it owns."""

    name: str
    loop: DutyLoop


class FencedDutyClass(Protocol[D_co]):
    """The constructor shape of a fenced duty (dispatcher, planner, reconciler, maintainer)."""

    def __call__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        clock: Clock = ...,
        is_leader: Callable[[], bool] | None = ...,
        shard: str = ...,
    ) -> D_co: ...


def from_context(duty: FencedDutyClass[D_co], ctx: DutyContext) -> D_co:
    """The fenced duty a replica runs: its settings, pool, clock, lease check and shard."""
    return duty(ctx.settings, ctx.pool, clock=ctx.clock, is_leader=ctx.is_leader, shard=ctx.shard)


class DutyLoop:
    """The owned loop around one duty's ``run_once`` (see the module docstring)."""

    def __init__(
        self, work: Work, *, shard: str = DEFAULT_SHARD, max_backoff: float = MAX_BACKOFF
    ) -> None:
        self.work = work
        self.name = work.name
        self.shard = shard  # the label of the duty's failures: whose work failed
        self.max_backoff = max_backoff
        self._setup: Callable[[], Awaitable[None]] | None = getattr(work, "setup", None)
        self._teardown: Callable[[], Awaitable[None]] | None = getattr(work, "teardown", None)
        self._term: LeaderTerm | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.stopped_by_request = False
        self.failures = 0
        self.log: Any = get_logger(f"duetime.{self.name}")

    @property
    def term(self) -> LeaderTerm:
        if self._term is None:
            raise RuntimeError(f"duty {self.name} used outside a leadership term")
        return self._term

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def bind(self, term: LeaderTerm) -> None:
        """Set the term without starting the loop (tests drive ``run_once`` directly)."""
        self._term = term
        self.log = get_logger(f"duetime.{self.name}", node_id=term.node_id, epoch=term.epoch)

    def start(self, term: LeaderTerm) -> asyncio.Task[None]:
        if self._task is not None and not self._task.done():
            raise RuntimeError(f"duty {self.name} already running")
        self.bind(term)
        self.stopped_by_request = False
        self.failures = 0
        self._task = asyncio.create_task(self._loop(), name=f"duty:{self.name}")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self.stopped_by_request = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Fenced, LeadershipLost):
            await task
        # a task that died with any other error was logged by _loop already

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        ready = self._setup is None
        try:
            while True:
                try:
                    if not ready:
                        assert self._setup is not None
                        await self._setup()
                        ready = True
                    delay = await self.work.run_once()
                    self.failures = 0
                except (Fenced, LeadershipLost):
                    raise
                except asyncio.CancelledError:
                    raise
                except Exception:
                    if _cancel_requested():
                        raise asyncio.CancelledError from None
                    self.failures += 1
                    DUTY_FAILURES.labels(self.shard, self.name).inc()
                    delay = bounded_jitter(self.failures, base=0.2, cap=self.max_backoff)
                    self.log.exception(
                        "duty_failed", duty=self.name, failures=self.failures, retry_in=delay
                    )
                    if ready:
                        ready = self._setup is None
                        await self._safe_teardown()
                if _cancel_requested():
                    raise asyncio.CancelledError
                await self._sleep(delay)
        finally:
            await self._safe_teardown()

    async def _safe_teardown(self) -> None:
        """Run ``teardown`` to its end even when ``stop()`` cancels us meanwhile, then let
        that cancellation through: swallowed here (teardown after a failed pass), it
        would keep the loop running until the replica's stop timeout (10 s)."""
        if self._teardown is None:
            return
        teardown = asyncio.ensure_future(self._teardown())
        try:
            await asyncio.shield(teardown)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await teardown
            raise
        except Exception:
            self.log.exception("duty_teardown_failed", duty=self.name)

    async def _sleep(self, delay: float) -> None:
        if self._wake.is_set():
            self._wake.clear()
            return
        if delay <= 0:
            await asyncio.sleep(0)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=delay)
        self._wake.clear()


def _cancel_requested() -> bool:
    """``stop()`` cancelled the running task, even if the pass it interrupted answered
    with another error or returned: asyncpg turns a cancelled query on a connection that
    died meanwhile into ``InterfaceError`` ("connection is closed"); taken for a failed
    pass, it would keep the loop running until the replica's stop timeout (10 s)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


# -- what the fenced duties share ------------------------------------------------------


class FencedWrites:
    """A duty's writes under the fence: the lease check, then a pooled fenced transaction.

    ``write`` names the write in the ``LeadershipLost`` raised when the lease can no
    longer be proven alive.
    """

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        write: str,
        is_leader: Callable[[], bool] | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.write = write
        self._is_leader = is_leader

    def check_lease(self) -> None:
        if self._is_leader is not None and not self._is_leader():
            raise LeadershipLost(f"lease not provably alive before a {self.write}")

    @asynccontextmanager
    async def transaction(self, epoch: int) -> AsyncIterator[Conn]:
        """A pooled connection in a fenced transaction of ``epoch``, after the lease check."""
        self.check_lease()
        async with (
            self.pool.acquire(timeout=self.settings.db_timeout) as conn,
            fenced_transaction(conn, epoch),
        ):
            yield conn


class DutyPublisher:
    """What a duty that publishes job messages holds: the ``DispatchStore`` it claims
    with, its publisher (its own, opened per term and closed on teardown, or a shared
    one) and the ``BrokerGate`` in front of it."""

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        name: str,
        publish_timeout: float,
        publisher: Publisher | None,
        gate: GateConfig,
        log: Callable[[], Any],
        shard: str = DEFAULT_SHARD,
    ) -> None:
        self.store = DispatchStore(pool, acquire_timeout=settings.db_timeout)
        self.owned = publisher is None
        self.publisher = publisher or Publisher.from_settings(
            settings, name=f"duetime-{name}", publish_timeout=publish_timeout, shard=shard
        )
        self.gate = BrokerGate(self.publisher, log, gate)

    async def open(self) -> None:
        await self.publisher.open()

    async def close(self) -> None:
        if self.owned:
            await self.publisher.close()


def publishing_parts(
    duty: Work,
    settings: Settings,
    pool: asyncpg.Pool,
    *,
    publish_timeout: float,
    publisher: Publisher | None,
    gate: GateConfig,
    is_leader: Callable[[], bool] | None,
    shard: str,
) -> tuple[DutyLoop, FencedWrites, DutyPublisher]:
    """The collaborators of a duty that claims rows and publishes them (the dispatcher,
    the reconciler): its loop, its fenced claim transactions and its publisher, wired the
    same way for both."""
    loop = DutyLoop(duty, shard=shard)
    writes = FencedWrites(settings, pool, write="fenced claim", is_leader=is_leader)
    out = DutyPublisher(
        settings,
        pool,
        name=duty.name,
        publish_timeout=publish_timeout,
        publisher=publisher,
        gate=gate,
        log=lambda: loop.log,
        shard=shard,
    )
    return loop, writes, out


@dataclass(frozen=True, slots=True)
class GateConfig:
    """How long a pass waits for a reconnecting broker, and the back-off after it."""

    ready_timeout: float
    base: float
    cap: float


class BrokerGate:
    """Whether the broker takes messages now, asked before every claim.

    ``delay()`` is 0 when it does; otherwise the seconds to wait: the publisher's
    back-pressure delay (RabbitMQ blocked the connection, or confirms pile up), or a
    jittered back-off while the connection is not ready within ``ready_timeout``.
    Transitions are logged, not every pause.
    """

    def __init__(self, publisher: Publisher, log: Callable[[], Any], config: GateConfig) -> None:
        self._publisher = publisher
        self._log = log
        self._config = config
        self.throttled = False
        self.not_ready = 0  # consecutive passes the broker was not ready

    async def delay(self) -> float:
        publisher = self._publisher
        throttle = publisher.throttle_delay()
        if throttle > 0:
            if not self.throttled:
                self._log().warning(
                    "dispatch_throttled",
                    blocked=publisher.blocked,
                    pressure=round(publisher.pressure, 3),
                    delay=round(throttle, 3),
                )
            self.throttled = True
            return throttle
        if self.throttled:
            self.throttled = False
            self._log().info("dispatch_unthrottled", pressure=round(publisher.pressure, 3))
        if not await publisher.wait_ready(self._config.ready_timeout):
            self.not_ready += 1
            delay = bounded_jitter(self.not_ready, base=self._config.base, cap=self._config.cap)
            self._log().warning(
                "broker_not_ready", failures=self.not_ready, retry_in=round(delay, 3)
            )
            return delay
        self.not_ready = 0
        return 0.0


def some_ids(ids: Sequence[int]) -> dict[str, object]:
    """The ``count`` and ``job_ids`` fields of a log line about many jobs (the first
    ``MAX_IDS_LOGGED`` ids)."""
    return {"count": len(ids), "job_ids": list(ids[:MAX_IDS_LOGGED])}


async def park_unreadable(
    store: DispatchStore,
    conn: Conn,
    rows: Sequence[UnreadableRow],
    *,
    duty: str,
    shard: str,
    log: Any,
) -> int:
    """Make each row dead with why, each under a savepoint: a park the database refuses
    (a row breaking an older NOT VALID CHECK) leaves that row as it is and the batch
    intact. Returns how many were parked."""
    parked_total = 0
    for row in rows:
        reason = f"the {duty} cannot read this row ({row.error}); parked as dead"
        try:
            async with conn.transaction():  # a savepoint
                parked = await store.park(conn, row.job_id, reason)
        except asyncpg.PostgresError as exc:
            parked = False
            reason = f"{reason}; the park was refused: {type(exc).__name__}: {exc}"
        parked_total += parked
        JOBS_PARKED.labels(shard, "unreadable").inc(parked)
        log.error(
            "job_unreadable",
            job_id=row.job_id,
            error=reason,
            outcome="dead" if parked else "left as it is",
        )
    return parked_total


def duty_listener(
    settings: Settings,
    channel: str,
    wake: Callable[[], None],
    *,
    role: str,
    check_interval: float,
    log: Callable[[], Any],
) -> KeptListener:
    """The LISTEN connection that wakes a duty, named ``duetime:<node>:<role>``."""
    return KeptListener(
        settings.database_url,
        channel,
        wake,
        timeout=settings.db_timeout,
        application_name=f"duetime:{settings.node_id}:{role}",
        check_interval=check_interval,
        log=log,
    )
