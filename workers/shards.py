"""A worker's shards: one handler pool, one store pool and one ``Executor`` per shard,
and the router that sends each delivery to the executor of its message's shard.

Why per shard, and not one pool that switches databases: effectively-once rests on the
ledger row, the job's status and the handler's ``ctx.db`` writes committing in one
transaction, and a transaction lives in one database. So ``ctx.db`` is a connection of
the job's own shard, the ledger is per shard, and a duplicate delivery is recognised by
the ledger of the shard that holds the job: effectively-once holds per shard.

Connection budget (docs/operations.md, "Connection budget"). A worker opens its pools
full at start (so the first burst after READY waits for no connection: a cold start
measured 16x the steady p99), and keeps few while idle: a connection idle for
``IDLE_SECONDS`` is closed down to the pool's minimum, ``HANDLER_WARM`` handler
connections (prepared) and ``STORE_WARM`` store ones. So one idle worker holds 6
connections a minute after its last burst, whatever its concurrency (kept open, two
workers at concurrency 32 would hold 72 of PostgreSQL's default 100), and at most
concurrency + ``settling_headroom(concurrency)`` + 8 under load (one store connection is
the attempt guard's while attempts run: ``scheduler.store.execution_guard``). Handlers
that never use ``ctx.db`` never take a handler connection. With K > 1 shards each shard
opens and keeps 1 + 2 and grows on demand. The concurrency limit is one limit across
shards (the consumer's), so the handler pools together never run more than
``concurrency`` handlers.

A delivery for a shard this worker is not configured with is not its to settle: it is
requeued at once a bounded number of times, so a worker that knows the shard can take
it, then dead-lettered (``workers.consumer``); a misconfigured worker never fails or
kills the job (its row stays ``dispatched`` for the shard's reconciler).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import asyncpg

from scheduler import db
from scheduler.config import Settings
from scheduler.errors import DuetimeError
from scheduler.log import get_logger
from scheduler.messages import JobMessage
from scheduler.store.execution import (
    ExecutionStore,
    prepare_handler_connection,
    prepare_store_connection,
)
from workers.cancel import CancelWatch
from workers.executor import Executor, Outcome
from workers.registry import Registry
from workers.slots import HandlerSlot
from workers.threads import ThreadRunner

__all__ = [
    "STORE_CONNECTIONS",
    "PoolSizes",
    "ShardExecutors",
    "UnknownShard",
    "WorkerShard",
    "close_pools",
    "open_shard",
    "pool_sizes",
]

log = get_logger("duetime.worker")

#: The worker's own statements (batched begin/complete, failure outcomes, heartbeats) run
#: on a pool of this size beside the ``concurrency`` connections of the handlers: four
#: batched reads and two batched completions in flight, two for failures and heartbeats.
STORE_CONNECTIONS = 8
#: Session settings of the handler connections. A handler stopped by its task's timeout
#: has its statement cancelled; when even that fails the connection is dropped, and
#: ``client_connection_check_interval`` (PostgreSQL 14+) makes the server notice the
#: closed socket within a second and stop the statement, instead of running it to its end.
HANDLER_SESSION = {"client_connection_check_interval": "1000"}
#: Handler connections a single-shard worker keeps open (and prepared) when idle.
HANDLER_WARM = 4
#: Store connections a single-shard worker keeps open when idle.
STORE_WARM = 2
#: Connections each pool of a shard keeps open when the worker has several shards.
SHARDED_HANDLER_MIN = 1
SHARDED_STORE_MIN = 2
#: A pooled connection idle this long is closed (down to the pool's minimum).
IDLE_SECONDS = 60.0
#: Most handler connections a worker holds beyond ``concurrency`` (``settling_headroom``).
SETTLING_HEADROOM_MAX = 4


def settling_headroom(concurrency: int) -> int:
    """Handler connections beyond ``concurrency``: a quarter of it, 1 to
    ``SETTLING_HEADROOM_MAX``.

    A slot is a running handler (``workers.slots``): a handler that used ``ctx.db``
    gives its slot back when it returned, while its transaction stays open until its
    outcome committed (``finish_attempt`` + COMMIT, one round trip). So up to
    ``concurrency`` running handlers and the ones settling hold transactions at once; the
    handler pool's size is what bounds them (``concurrency`` + this headroom): a handler
    whose first ``ctx.db`` statement finds every connection taken waits for a settling
    one to commit, one round trip. The headroom only spares that wait; it is kept small
    because PostgreSQL's connections are shared (two workers at concurrency 64 would
    otherwise add 32 backends)."""
    return min(SETTLING_HEADROOM_MAX, max(1, concurrency // 4))


class UnknownShard(DuetimeError):
    """A delivery names a shard this worker is not configured with."""

    def __init__(self, shard: str, known: tuple[str, ...]) -> None:
        super().__init__(f"shard {shard!r} is not one of this worker's shards ({', '.join(known)})")
        self.shard = shard
        self.known = known


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """min/max connections of one shard's handler pool and store pool."""

    handler_min: int
    handler_max: int
    store_min: int
    store_max: int
    #: connections opened at start: a single-shard worker opens its pools full (no cold
    #: start for the first burst) and shrinks to the minimum after ``IDLE_SECONDS`` idle
    handler_init: int = 0
    store_init: int = 0


def pool_sizes(shards: int, concurrency: int) -> PoolSizes:
    """The pools of one shard of a worker with ``shards`` shards (module docstring)."""
    if shards < 1 or concurrency < 1:
        raise ValueError(f"need shards >= 1 and concurrency >= 1 (got {shards}, {concurrency})")
    if shards == 1:
        return PoolSizes(
            min(concurrency, HANDLER_WARM),
            concurrency + settling_headroom(concurrency),
            STORE_WARM,
            STORE_CONNECTIONS,
            handler_init=concurrency,
            store_init=STORE_CONNECTIONS // 2,
        )
    return PoolSizes(
        SHARDED_HANDLER_MIN,
        concurrency + settling_headroom(concurrency),
        SHARDED_STORE_MIN,
        STORE_CONNECTIONS,
        handler_init=SHARDED_HANDLER_MIN,
        store_init=SHARDED_STORE_MIN,
    )


@dataclass(frozen=True, slots=True)
class WorkerShard:
    """One shard as a worker holds it."""

    name: str
    pool: asyncpg.Pool  # the handlers' transactions (``ctx.db``)
    store_pool: asyncpg.Pool  # the worker's own batched statements
    executor: Executor
    #: hears cancels of the jobs this shard's handlers run (workers.cancel)
    watch: CancelWatch


async def open_shard(
    settings: Settings,
    name: str,
    url: str,
    *,
    registry: Registry,
    sizes: PoolSizes,
    threads: ThreadRunner | None = None,
) -> WorkerShard:
    """Open one shard's pools (their warm connections, statements prepared) and its
    executor (``threads``: the worker's handler threads, shared by its shards). Raises
    after closing whatever it opened."""
    shard_settings = dataclasses.replace(settings, database_url=url)
    pool = await db.pool_from_settings(
        shard_settings,
        max_size=sizes.handler_max,
        min_size=sizes.handler_min,
        init_size=max(sizes.handler_init, sizes.handler_min),
        max_inactive_connection_lifetime=IDLE_SECONDS,
        prepare=prepare_handler_connection,
        reset=db.keep_session,  # see workers.executor: ctx.db work is transaction-scoped
        bound_statements=False,  # a handler's statements: its task's timeout bounds them
        server_settings=HANDLER_SESSION,
    )
    try:
        store_pool = await db.pool_from_settings(
            shard_settings,
            max_size=sizes.store_max,
            min_size=sizes.store_min,  # the reads and completions of a burst
            init_size=max(sizes.store_init, sizes.store_min),
            max_inactive_connection_lifetime=IDLE_SECONDS,
            prepare=prepare_store_connection,
            server_settings={"plan_cache_mode": "force_generic_plan"},
            reset=db.keep_session,  # only our statements run here: nothing to reset
        )
    except BaseException:
        await close_pools([pool], settings.db_timeout)
        raise
    store = ExecutionStore(store_pool, timeout=settings.db_timeout, budgets=registry.budgets())
    executor = Executor(
        pool,
        registry,
        worker_name=settings.node_id,
        heartbeat_interval=settings.visibility_timeout / 3,
        acquire_timeout=settings.db_timeout,
        task_timeout=settings.task_timeout,
        result_max_bytes=settings.result_max_bytes,
        store=store,
        shard=name,
        threads=threads,
    )
    watch = CancelWatch(
        url, executor.cancellations, store, timeout=settings.db_timeout, node_id=settings.node_id
    )
    watch.start()
    return WorkerShard(name, pool, store_pool, executor, watch)


async def close_pools(pools: list[asyncpg.Pool], timeout: float) -> None:
    """Close each pool gracefully within ``timeout``, else terminate it."""
    for pool in pools:
        try:
            await asyncio.wait_for(pool.close(), timeout)
        except Exception as exc:
            log.warning("pool_close_failed", error=repr(exc))
            pool.terminate()


class ShardExecutors:
    """Runs each delivery on the executor of its message's shard.

    ``execute`` has the ``Executor.execute`` contract (every return value: an outcome is
    committed; ``DatabaseUnavailable``: none could be) plus ``UnknownShard`` for a shard
    that has no executor here."""

    def __init__(self, executors: Mapping[str, Executor]) -> None:
        if not executors:
            raise ValueError("a worker needs at least one shard")
        self._executors = dict(executors)
        self.names = tuple(self._executors)

    def __getitem__(self, shard: str) -> Executor:
        return self._executors[shard]

    def __contains__(self, shard: object) -> bool:
        return shard in self._executors

    async def execute(
        self, msg: JobMessage, *, redelivered: bool = False, slot: HandlerSlot | None = None
    ) -> Outcome:
        executor = self._executors.get(msg.shard)
        if executor is None:
            raise UnknownShard(msg.shard, self.names)
        return await executor.execute(msg, redelivered=redelivered, slot=slot)

    async def ping(self, shard: str | None = None) -> None:
        """Raise unless ``shard``'s database answers (``workers.outage``)."""
        executor = self._executors.get(shard or "")
        if executor is None:
            raise UnknownShard(shard or "", self.names)
        await executor.ping()

    def batching(self) -> dict[str, dict[str, float]]:
        """Each shard's ``Executor.batching()``."""
        return {name: executor.batching() for name, executor in self._executors.items()}

    async def close(self) -> None:
        for executor in self._executors.values():
            await executor.close()
