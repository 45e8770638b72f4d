"""The worker process: connections, pools, lifecycle and graceful shutdown.

``Worker`` wires the pieces: an asyncpg pool sized to ``concurrency`` plus a few for the
batched statements and heartbeats (without asyncpg's session reset on release:
``db.keep_session``), a robust RabbitMQ connection with one channel, an ``Executor``
(runs a delivery and records its outcome) and a ``Consumer`` (deliveries, acks).

No cold start: the pools open every connection before the worker reports ready, each
with the worker's statements already prepared (``scheduler.store.execution``), and never
close idle ones. Measured before: the first 1.5 s of jobs after READY started 300-400 ms late
while the pool grew and planned on the first burst.

``Worker.run()`` (``run_worker``) is what ``duetime worker`` runs: the shared service
scaffold turns the first SIGTERM/SIGINT into a graceful stop and a second into an
immediate exit.

Shutdown order matters: stop consuming first (nothing new arrives), then let running
handlers finish within the grace period, cancel the rest (their transactions roll back
and their messages go back to the queue), and only then close the channel, the
connection and the pool. Unacked messages of a process that dies instead (kill -9) are
requeued by RabbitMQ when its connection drops, and PostgreSQL aborts its transactions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import asyncpg
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from scheduler import broker, db
from scheduler.config import Settings
from scheduler.jobspec import validate_queue
from scheduler.log import get_logger
from scheduler.startup import start_with_retry
from scheduler.store.execution import (
    ExecutionStore,
    prepare_handler_connection,
    prepare_store_connection,
)
from workers.consumer import Consumer
from workers.executor import Executor
from workers.registry import Registry, default_registry

log = get_logger("duetime.worker")

#: The worker's own statements (batched begin/complete, failure outcomes, heartbeats) run
#: on a pool of this size beside the ``concurrency`` connections of the handlers: four
#: batched reads and two batched completions in flight, two for failures and heartbeats.
STORE_CONNECTIONS = 8


class Worker:
    """One worker: ``start()``, then ``stop()`` (safe before start and twice).

    A ``start()`` that raises has closed what it opened, so it can be called again.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        queues: Sequence[str],
        registry: Registry | None = None,
        concurrency: int | None = None,
        grace_period: float | None = None,
    ) -> None:
        if not queues:
            raise ValueError("a worker needs at least one queue")
        self.settings = settings
        self.queues = [validate_queue(q) for q in dict.fromkeys(queues)]
        self.registry = registry if registry is not None else default_registry
        self.concurrency = concurrency or settings.worker_concurrency
        self.grace_period = settings.worker_grace_period if grace_period is None else grace_period
        self.pool: asyncpg.Pool | None = None
        self.store_pool: asyncpg.Pool | None = None
        self.connection: AbstractRobustConnection | None = None
        self.channel: AbstractChannel | None = None
        self.consumer: Consumer | None = None
        self.executor: Executor | None = None
        self._stopped = False

    async def start(self) -> None:
        s = self.settings
        self.pool = await db.pool_from_settings(
            s,
            max_size=self.concurrency,
            min_size=self.concurrency,
            max_inactive_connection_lifetime=0,
            prepare=prepare_handler_connection,
            reset=db.keep_session,  # see workers.executor: ctx.db work is transaction-scoped
        )
        try:
            self.store_pool = await db.pool_from_settings(
                s,
                max_size=STORE_CONNECTIONS,
                min_size=STORE_CONNECTIONS // 2,  # the reads and completions of a burst
                max_inactive_connection_lifetime=0,
                prepare=prepare_store_connection,
                server_settings={"plan_cache_mode": "force_generic_plan"},
                reset=db.keep_session,  # only our statements run here: nothing to reset
            )
            self.executor = Executor(
                self.pool,
                self.registry,
                worker_name=s.node_id,
                heartbeat_interval=s.visibility_timeout / 3,
                acquire_timeout=s.db_timeout,
                task_timeout=s.task_timeout,
                store=ExecutionStore(self.store_pool, timeout=s.db_timeout),
            )
            self.consumer = Consumer(
                self.executor, concurrency=self.concurrency, timeout=s.amqp_timeout
            )
            # Reconnect every second (aio-pika's default is 5 s): each broker blip would
            # otherwise cost at least 5 s of consumption (found by the chaos suite).
            self.connection = await broker.connect(
                s.amqp_url,
                timeout=s.amqp_timeout,
                name=f"duetime-worker:{s.node_id}",
                reconnect_interval=1.0,
            )
            self.channel = await asyncio.wait_for(self.connection.channel(), s.amqp_timeout)
            await self.consumer.start(self.channel, self.queues, delivery_limit=s.delivery_limit)
        except BaseException:
            consumer, self.consumer = self.consumer, None
            if consumer is not None:
                await consumer.abort()
            await self._close()
            raise
        log.info(
            "worker_started",
            queues=self.queues,
            concurrency=self.concurrency,
            tasks=self.registry.names(),
            node_id=s.node_id,
        )

    async def stop(self, grace_period: float | None = None) -> None:
        """Graceful stop: no new deliveries, running handlers get the grace period."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.grace_period if grace_period is None else grace_period
        cancelled = 0
        if self.consumer is not None:
            log.info("worker_stopping", in_flight=self.consumer.in_flight, grace=grace)
            cancelled = await self.consumer.drain(grace)
        batching = self.executor.batching() if self.executor is not None else {}
        acks = self.consumer.ack_frames if self.consumer is not None else 0
        await self._close()
        log.info("worker_stopped", cancelled=cancelled, ack_frames=acks, **batching)

    async def _close(self) -> None:
        executor, self.executor = self.executor, None
        if executor is not None:
            await executor.close()
        timeout = self.settings.amqp_timeout
        channel, self.channel = self.channel, None
        connection, self.connection = self.connection, None
        pools = (self.pool, self.store_pool)
        self.pool = self.store_pool = None
        for resource in (channel, connection):
            if resource is not None:
                try:
                    await asyncio.wait_for(resource.close(), timeout)
                except Exception as exc:
                    log.warning("broker_close_failed", error=repr(exc))
        for pool in pools:
            if pool is not None:
                try:
                    await asyncio.wait_for(pool.close(), self.settings.db_timeout)
                except Exception as exc:
                    log.warning("pool_close_failed", error=repr(exc))
                    pool.terminate()

    async def run(self) -> int:
        """Run until SIGTERM/SIGINT, then stop gracefully; exit status 0."""
        from scheduler.service import Service

        async with Service("worker", metrics_port=self.settings.metrics_port) as service:
            try:
                # a broker or database blip at start is retried, not fatal (scheduler.startup)
                if not await start_with_retry(self.start, service.stop_event, service="worker"):
                    return 0
                service.ready()
                service.status(f"consuming {', '.join(self.queues)}")
                await service.stop_event.wait()
            finally:
                await self.stop()
        return 0

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


async def run_worker(settings: Settings, **options: Any) -> int:
    """``Worker(settings, **options).run()``: what ``duetime worker`` runs."""
    return await Worker(settings, **options).run()
