"""The worker process: connections, pools, lifecycle and graceful shutdown.

``Worker`` wires the pieces: per shard (``Settings.shard_urls``; one, ``main``, unless
shards are configured) an asyncpg pool for the handlers plus a few connections for the
batched statements and heartbeats (without asyncpg's session reset on release:
``db.keep_session``) and an ``Executor`` (runs a delivery and records its outcome);
``workers.shards`` sizes the pools and routes each delivery to its shard's executor. One
robust RabbitMQ connection with one channel and one ``Consumer`` (deliveries, acks, the
concurrency limit) serve every shard.

No cold start: the pools open every connection before the worker reports ready, each
with the worker's statements already prepared (``scheduler.store.execution``), and close
idle ones only down to a warm minimum. Opened on demand instead, the first 1.5 s of jobs
after READY started 300-400 ms late while the pool grew and planned on the first burst.
(With several shards the handler pools open one connection each and grow on demand: the
connection budget in ``workers.shards``.)

``Worker.run()`` (``run_worker``) is what ``duetime worker`` runs: the shared service
scaffold turns the first SIGTERM/SIGINT into a graceful stop and a second into an
immediate exit.

Readiness (``/readyz``, ``readiness_checks``): ready means consuming, with its pools
open. ``amqp`` fails until the broker connection is up and again whenever it is lost
(the robust connection reconnects every second meanwhile); ``consuming`` fails until the
consumers of every queue exist; ``db`` (``db_<shard>`` with shards) fails until the
shard's pools are open and once they close. They fail while ``start()`` is retried
against a broker or database that is down, so a worker that consumes nothing never
looks ready.

Shutdown order matters: stop consuming first (nothing new arrives), then let running
handlers finish within the grace period, cancel the rest (their transactions roll back
and their messages go back to the queue), and only then close the channel, the
connection and the pool. Unacked messages of a process that dies instead (kill -9) are
requeued by RabbitMQ when its connection drops, and PostgreSQL aborts its transactions.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

import asyncpg
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from scheduler import broker
from scheduler.broker import queue_name
from scheduler.config import Settings
from scheduler.health import Check, NotReady
from scheduler.jobspec import validate_queue
from scheduler.log import get_logger
from scheduler.observability import broker_connected
from scheduler.startup import start_with_retry
from workers.consumer import Consumer
from workers.executor import Executor
from workers.lifecycle import WorkerStartupFailed
from workers.registry import Registry, default_registry
from workers.shards import (
    STORE_CONNECTIONS,
    ShardExecutors,
    WorkerShard,
    close_pools,
    open_shard,
    pool_sizes,
)
from workers.threads import RESTART_EXIT_STATUS, ThreadRunner

__all__ = ["STORE_CONNECTIONS", "Worker", "run_worker"]

log = get_logger("duetime.worker")


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
        threads: int | None = None,
    ) -> None:
        if not queues:
            raise ValueError("a worker needs at least one queue")
        self.settings = settings
        self.queues = [validate_queue(q) for q in dict.fromkeys(queues)]
        self.registry = registry if registry is not None else default_registry
        self.concurrency = concurrency or settings.worker_concurrency
        self.grace_period = settings.worker_grace_period if grace_period is None else grace_period
        #: threads for plain ``def`` handlers (``workers.threads``), shared by the shards
        self.threads = threads or settings.worker_threads or self.concurrency
        self.thread_runner: ThreadRunner | None = None
        #: set when too many handler threads were abandoned: ``run()`` stops and exits
        #: with ``RESTART_EXIT_STATUS`` for the supervisor to start a fresh process
        self.restart_requested = asyncio.Event()
        #: name -> pools and executor of each shard, in configured order (set by start)
        self.shards: dict[str, WorkerShard] = {}
        self.executors: ShardExecutors | None = None
        self.connection: AbstractRobustConnection | None = None
        self.channel: AbstractChannel | None = None
        #: the staged deliveries' channel (``workers.staging``), when the worker takes any
        self.staged_channel: AbstractChannel | None = None
        self.consumer: Consumer | None = None
        self._hooks_started = False
        self._stopped = False

    # The first shard's pools and executor: with one shard (the default), the worker's.
    @property
    def pool(self) -> asyncpg.Pool | None:
        return next(iter(self.shards.values())).pool if self.shards else None

    @property
    def store_pool(self) -> asyncpg.Pool | None:
        return next(iter(self.shards.values())).store_pool if self.shards else None

    @property
    def executor(self) -> Executor | None:
        return next(iter(self.shards.values())).executor if self.shards else None

    def readiness_checks(self) -> dict[str, Check]:
        """The worker's ``/readyz`` checks (module docstring): ``amqp``, ``consuming``
        and one pools check per shard."""
        checks: dict[str, Check] = {"amqp": self._check_broker, "consuming": self._check_consuming}
        for name in self.settings.shard_urls:
            key = "db" if self.settings.shards is None else f"db_{name}"
            checks[key] = functools.partial(self._check_pools, name)
        return checks

    def _check_broker(self) -> None:
        if self.connection is None:
            raise NotReady("no broker connection yet (start is being retried)")
        if not broker_connected(self.connection):
            raise NotReady("broker connection lost (reconnecting)")

    def _check_consuming(self) -> None:
        consuming = self.consumer.consuming if self.consumer is not None else []
        missing = [q for q in self.queues if queue_name(q) not in consuming]
        if missing:
            raise NotReady(f"not consuming {', '.join(missing)}")

    def _check_pools(self, name: str) -> None:
        shard = self.shards.get(name)
        if shard is None:
            raise NotReady("pools not open yet")
        if shard.pool.is_closing() or shard.store_pool.is_closing():
            raise NotReady("pools closed")

    async def start(self) -> None:
        s = self.settings
        urls = s.shard_urls
        sizes = pool_sizes(len(urls), self.concurrency)
        self.thread_runner = ThreadRunner(
            self.threads,
            max_abandoned=s.worker_max_abandoned_threads,
            on_exhausted=self.restart_requested.set,
        )
        try:
            for name, url in urls.items():
                self.shards[name] = await open_shard(
                    s, name, url, registry=self.registry, sizes=sizes, threads=self.thread_runner
                )
            self.executors = ShardExecutors({n: sh.executor for n, sh in self.shards.items()})
            self.consumer = Consumer(
                self.executors,
                concurrency=self.concurrency,
                timeout=s.amqp_timeout,
                stage_limit=s.worker_stage_limit,
                prefetch=max(s.worker_prefetch, self.concurrency) if s.worker_prefetch else 0,
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
            if s.worker_stage_limit > 0:
                # its own prefetch, and its own acks: a staged delivery held for seconds
                # must not stop the multiple-acks of the due ones (AckCoalescer)
                self.staged_channel = await asyncio.wait_for(
                    self.connection.channel(), s.amqp_timeout
                )
            # What handlers share is opened before the first delivery can arrive; a
            # failing hook raises here, and nothing was consumed.
            self._hooks_started = True
            await self.registry.lifecycle.start()
            await self.consumer.start(
                self.channel,
                self.queues,
                delivery_limit=s.delivery_limit,
                staged_channel=self.staged_channel,
            )
        except BaseException as exc:
            consumer, self.consumer = self.consumer, None
            if consumer is not None:
                await consumer.abort()
            if self._hooks_started and not isinstance(exc, WorkerStartupFailed):
                await self.registry.lifecycle.stop()  # a later step failed: close theirs
            self._hooks_started = False
            await self._close()
            raise
        log.info(
            "worker_started",
            queues=self.queues,
            concurrency=self.concurrency,
            threads=self.threads,
            stage_limit=s.worker_stage_limit,
            tasks=self.registry.names(),
            node_id=s.node_id,
            shards=list(self.shards),
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
        per_shard = self.executors.batching() if self.executors is not None else {}
        # one shard: its counters as before; several: one dict per shard
        batching = next(iter(per_shard.values())) if len(per_shard) == 1 else {"shards": per_shard}
        acks = self.consumer.ack_frames if self.consumer is not None else 0
        if self._hooks_started:  # after the last job, before the pools close
            self._hooks_started = False
            await self.registry.lifecycle.stop()
        await self._close()
        log.info("worker_stopped", cancelled=cancelled, ack_frames=acks, **batching)

    async def _close(self) -> None:
        shards, self.shards = self.shards, {}
        self.executors = None
        for shard in shards.values():
            await shard.watch.close()
            await shard.executor.close()
        runner, self.thread_runner = self.thread_runner, None
        if runner is not None:
            runner.close()
        channels = [c for c in (self.staged_channel, self.channel) if c is not None]
        self.channel = self.staged_channel = None
        connection, self.connection = self.connection, None
        for channel in channels:  # bounded: the broker may be unreachable (broker.py)
            try:
                await asyncio.wait_for(channel.close(), broker.CLOSE_TIMEOUT)
            except Exception as exc:
                log.warning("broker_close_failed", error=repr(exc))
        if connection is not None:
            await broker.close_connection(connection, broker.CLOSE_TIMEOUT)
        pools = [pool for shard in shards.values() for pool in (shard.pool, shard.store_pool)]
        await close_pools(pools, self.settings.db_timeout)

    async def run(self) -> int:
        """Run until SIGTERM/SIGINT, then stop gracefully; exit status 0. Too many
        abandoned handler threads (``workers.threads``) stop it the same way, with exit
        status ``RESTART_EXIT_STATUS`` (not when they were abandoned by the stop itself:
        handlers cancelled after the grace period)."""
        from scheduler.service import Service

        restart = False

        async with Service(
            "worker",
            metrics_port=self.settings.metrics_port,
            metrics_host=self.settings.metrics_listen,
            checks=self.readiness_checks(),
        ) as service:
            try:
                # a broker or database blip at start is retried, not fatal (scheduler.startup)
                if not await start_with_retry(self.start, service.stop_event, service="worker"):
                    return 0
                service.ready()
                service.status(f"consuming {', '.join(self.queues)}")
                await _first(service.stop_event, self.restart_requested)
                # asked to stop (SIGTERM) first: a normal stop, whatever happens after
                restart = not service.stop_event.is_set()
            finally:
                await self.stop()
        if restart:
            log.error("worker_exit_for_restart", exit_status=RESTART_EXIT_STATUS)
            return RESTART_EXIT_STATUS
        return 0

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


async def _first(*events: asyncio.Event) -> None:
    """Wait until any of ``events`` is set."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def run_worker(settings: Settings, **options: Any) -> int:
    """``Worker(settings, **options).run()``: what ``duetime worker`` runs."""
    return await Worker(settings, **options).run()
