"""The broker side of a worker: deliveries in, acks out, at most N handlers at once.

Each delivery becomes one asyncio task owned by the ``Consumer`` (aio-pika's own
callback task only hands it over). A semaphore of size ``concurrency`` bounds the
handlers running at once (``workers.slots``: a delivery takes its slot after its begin
read and gives it back when its handler returned, before its outcome is settled).
Prefetch per queue is ``prefetch_for(N)``: the running handlers and a fixed room for
deliveries in batched begin reads, waiting for a slot, and in batched settlements.
Staged deliveries (held until their run time on a channel of their own) get the same
room when they come due (``_handle_staged``).

Settlement rules (DESIGN §6):

- ack only after an outcome committed (``Executor.execute`` returned). Acks that become
  due together go out as few frames as possible (``AckCoalescer``): one
  ``basic.ack(multiple=True)`` covers a run of settled deliveries with no unsettled one
  below it, so a batch completed by one statement is acked by one frame;
- a body that is not a job (``MalformedMessage``) → ``reject(requeue=False)``: the
  queue's dead-letter exchange moves it to ``duetime.dead-letter``; counted and logged
  with its ``message_id``;
- no outcome could be recorded (``DatabaseUnavailable``) → nack with requeue once the
  shard's database answers again, or after ``db_retry_cap`` seconds (``workers.outage``:
  a probe while deliveries wait), so a database outage neither becomes a hot redelivery
  loop nor keeps the worker idle after it ended. Past the queue's delivery limit RabbitMQ
  dead-letters the message; the job row is still ``dispatched`` and the reconciler
  publishes it again after the visibility timeout, so nothing is lost;
- a shard this worker is not configured with (``UnknownShard``, checked before the
  delivery takes a handler slot) → logged as an error naming both; nacked with requeue
  *at once* while the message has been delivered fewer than ``UNKNOWN_SHARD_DELIVERIES``
  times (quorum queues count them in ``x-delivery-count``), so during a rolling deploy a
  worker that already knows the shard can take it; after that, rejected to the
  dead-letter exchange and counted (``duetime_deliveries_dropped_total{reason=
  "unknown_shard"}``). Nothing waits on a delay holding a prefetch slot, so such
  messages cannot stall a queue. The job is never failed for it: a real job's row stays
  ``dispatched`` and its shard's reconciler publishes it again after the visibility
  timeout (a forged shard name has no row and no reconciler: it stays dead-lettered);
- a redelivered copy of an attempt another worker process is running
  (``AttemptRunningElsewhere``) → nack with requeue after
  ``RUNNING_ELSEWHERE_REQUEUE`` seconds (a fresh copy is acked by the executor without a
  run; ``Executor._running_elsewhere`` says why the two differ);
- shutdown: deliveries whose handler never started (in their begin read, or waiting for
  a slot) are nacked with requeue at once; running ones get the grace period, then are
  cancelled (their transaction rolls back) and nacked.

An ack that fails (channel closed by a broker reconnect) is only logged: the broker
redelivers the message and the ledger recognises it as already settled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from scheduler.backoff import bounded_jitter
from scheduler.broker import CLOSE_TIMEOUT, declare_job_queue
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.log import get_logger
from scheduler.messages import JobMessage, MalformedMessage, decode
from scheduler.metrics import (
    DELIVERIES_DROPPED,
    DELIVERIES_REQUEUED,
    HANDLERS_RUNNING,
    MALFORMED_MESSAGES,
    STAGED_DUE_WAITING,
    STAGED_RELEASED,
)
from workers.acks import AckCoalescer, Settlement
from workers.errors import AttemptRunningElsewhere, DatabaseUnavailable
from workers.executor import RUNNING_ELSEWHERE_REQUEUE, Executor
from workers.outage import Outage
from workers.shards import ShardExecutors, UnknownShard
from workers.slots import HandlerSlot
from workers.staging import StagedDeliveries

log = get_logger("duetime.worker")

#: Unacked deliveries a worker keeps beyond its running handlers: deliveries in flight
#: through the batched begin read, waiting for a slot, and in the batched settlement.
#: How many a short handler needs depends on the batches' round trips, not on N (Little's
#: law: with prefetch = 3 x N, 30 deliveries over a ~14 ms begin-run-settle-ack cycle
#: bound a noop handler at N = 10 to ~2,100 jobs/s, half of N = 64). 64 left N = 10 at
#: 0.76 x of N = 64, 128 at 0.93-0.97 x; N = 64 keeps its 192 (docs/benchmarks.md, "A slot
#: is a running handler, from the begin on"). Operators running long jobs lower prefetch
#: with ``worker_prefetch``: a delivery waiting in one worker is one an idle worker
#: cannot take.
SETTLING_PREFETCH = 128
DB_RETRY_BASE = 0.5
DB_RETRY_CAP = 10.0
#: Deliveries a message for an unknown shard gets (each requeued at once, no delay) before
#: it is dead-lettered: a few chances for a worker that knows the shard, never a stall.
UNKNOWN_SHARD_DELIVERIES = 3


def prefetch_for(concurrency: int, configured: int = 0) -> int:
    """RabbitMQ prefetch per queue for a worker running ``concurrency`` handlers:
    ``configured`` (the ``worker_prefetch`` setting) when set, else concurrency +
    ``SETTLING_PREFETCH``."""
    if configured:
        return configured
    return concurrency + SETTLING_PREFETCH


class Consumer:
    """Consumes job queues on one channel and runs each delivery through the executor."""

    def __init__(
        self,
        executor: Executor | ShardExecutors,
        *,
        concurrency: int,
        timeout: float = 10.0,
        db_retry_cap: float = DB_RETRY_CAP,
        stage_limit: int = 0,
        prefetch: int = 0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (got {concurrency})")
        if prefetch and prefetch < concurrency:
            raise ValueError(f"prefetch {prefetch} is below concurrency {concurrency}")
        self._executor = executor
        self._acks = AckCoalescer()
        self.concurrency = concurrency
        self.prefetch = prefetch_for(concurrency, prefetch)
        self._timeout = timeout
        self._db_retry_cap = db_retry_cap
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: set[asyncio.Task[None]] = set()
        self._consumers: list[tuple[AbstractQueue, str]] = []
        self._db_failures = 0
        self._outages: dict[str, Outage] = {}  # per shard, once a delivery failed on it
        self.stopping = False
        self.active = 0  # handler slots taken right now (workers.slots)
        self.peak = 0  # most handler slots ever taken at once
        self.requeued = 0  # deliveries nacked back because no outcome could be recorded
        #: staged deliveries held at most (the staged channel's prefetch; 0: none taken)
        self.stage_limit = stage_limit
        self._clock = clock
        self._staged: StagedDeliveries[tuple[AbstractIncomingMessage, JobMessage]] = (
            StagedDeliveries(self._start_staged, clock=clock)
        )
        #: staged deliveries whose run time came that may be in their begin read or
        #: waiting for a slot at once (``_handle_staged``): as many as the due queues'
        #: prefetch lets in, so that a storm of staged jobs holds no more guard locks
        #: and database work than a backlog of due ones
        self._staged_room = asyncio.Semaphore(self.prefetch)

    @property
    def ack_frames(self) -> int:
        """basic.ack frames sent so far (one may settle many deliveries)."""
        return self._acks.frames

    @property
    def consuming(self) -> list[str]:
        """The queues consumed right now (empty before ``start`` and once stopping).
        The broker consumers survive a reconnect (the robust channel restores them);
        whether the connection is up is the worker's ``amqp`` readiness check."""
        return [] if self.stopping else [queue.name for queue, _ in self._consumers]

    @property
    def in_flight(self) -> int:
        """Deliveries received and not yet settled (staged ones held included)."""
        return len(self._tasks) + len(self._staged)

    @property
    def staged(self) -> int:
        """Staged deliveries held until their run time."""
        return len(self._staged)

    async def start(
        self,
        channel: AbstractChannel,
        queues: Sequence[str],
        *,
        delivery_limit: int,
        staged_channel: AbstractChannel | None = None,
    ) -> None:
        """Declare the queues, set prefetch (``prefetch_for``), and
        start consuming. With ``staged_channel`` and a ``stage_limit``, the queues'
        staged twins too, on that channel, with prefetch ``stage_limit``
        (``workers.staging``)."""
        await channel.set_qos(prefetch_count=self.prefetch, timeout=self._timeout)
        for name in queues:
            queue = await declare_job_queue(channel, name, delivery_limit=delivery_limit)
            tag = await queue.consume(self._on_message, no_ack=False, timeout=self._timeout)
            self._consumers.append((queue, tag))
        if staged_channel is None or self.stage_limit < 1:
            return
        self._staged.start()
        await staged_channel.set_qos(prefetch_count=self.stage_limit, timeout=self._timeout)
        for name in queues:
            queue = await declare_job_queue(
                staged_channel, name, delivery_limit=delivery_limit, staged=True
            )
            tag = await queue.consume(self._on_staged, no_ack=False, timeout=self._timeout)
            self._consumers.append((queue, tag))

    async def stop_consuming(self) -> None:
        """Cancel the broker consumers (no new deliveries); safe twice."""
        self.stopping = True
        consumers, self._consumers = self._consumers, []
        # Bounded by CLOSE_TIMEOUT, not amqp_timeout: a robust channel waits to be
        # reconnected first, and a stop must not wait for an unreachable broker. A cancel
        # that does not finish loses nothing: the deliveries it would have stopped stay
        # unacked, and the broker requeues them when the connection closes.
        for queue, tag in consumers:
            try:
                await asyncio.wait_for(queue.cancel(tag, timeout=CLOSE_TIMEOUT), CLOSE_TIMEOUT)
            except Exception as exc:  # channel already gone: nothing will arrive anyway
                log.warning("consumer_cancel_failed", queue=queue.name, error=repr(exc))
        if consumers:
            log.info("consuming_stopped", queues=[q.name for q, _ in consumers])

    async def drain(self, grace: float) -> int:
        """Stop: give staged deliveries back, nack waiting ones, give running ones
        ``grace`` seconds, cancel the rest. Returns how many running deliveries had to
        be cancelled."""
        await self.stop_consuming()
        await self._give_back_staged()
        for task in list(self._tasks - self._running):
            task.cancel()  # not started: back to the queue at once
        pending: set[asyncio.Task[None]] = set()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
        for task in pending:
            task.cancel()
        if pending:
            log.warning("deliveries_cancelled_after_grace", count=len(pending), grace=grace)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._close_outages()
        await self._acks.close(CLOSE_TIMEOUT)
        return len(pending)

    async def abort(self) -> None:
        """A start that failed half-way: cancel whatever deliveries already began (their
        transactions roll back; the broker requeues them when the channel closes)."""
        self.stopping = True
        self._consumers = []
        await self._staged.close()  # unacked: the broker requeues them with the channel
        for task in list(self._tasks):
            task.cancel()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._close_outages()
        await self._acks.close(CLOSE_TIMEOUT)

    async def _close_outages(self) -> None:
        for outage in self._outages.values():
            await outage.close()

    # -- deliveries ------------------------------------------------------------------

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        if self.stopping:  # arrived between our cancel and the broker's CancelOk
            await Settlement(message, self._acks)("nack", requeue=True)
            return
        self._acks.received(message)
        self._run(message, self._handle(message, None))

    def _run(self, message: AbstractIncomingMessage, handle: Coroutine[Any, Any, None]) -> None:
        """Own ``handle`` (one delivery's way through the worker) as a task."""
        task = asyncio.create_task(handle, name=f"delivery:{message.message_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_staged(
        self, message: AbstractIncomingMessage, msg: JobMessage | None, *, timed: bool
    ) -> None:
        """A staged delivery whose run time came, handled like a due one once there is
        room (``_staged_room``). Up to ``stage_limit`` staged deliveries can come due at
        the same instant, and every delivery holds its attempt's guard lock (a
        PostgreSQL advisory lock, ``scheduler.store.execution_guard``) from its begin
        read until its outcome commits; begun all at once, 20,000 of them would fill
        PostgreSQL's lock table, which every session of the server shares ("out of
        shared memory"). Waiting here holds nothing but the message, and a delivery
        cancelled while it waits (the worker stopping) goes back to the queue.
        ``timed``: released by the worker's timer (counted in
        ``duetime_staged_released_total`` once it has room, or as requeued)."""
        STAGED_DUE_WAITING.inc()
        try:
            await self._staged_room.acquire()
        except asyncio.CancelledError:
            await Settlement(message, self._acks)("nack", requeue=True)
            if timed:
                STAGED_RELEASED.labels("requeued").inc()
            raise
        finally:
            STAGED_DUE_WAITING.dec()
        if timed:
            STAGED_RELEASED.labels("started").inc()
        try:
            await self._handle(message, msg)
        finally:
            self._staged_room.release()

    async def _on_staged(self, message: AbstractIncomingMessage) -> None:
        """A staged delivery: held until its run time (``workers.staging``), or run now
        when that time has passed (a redelivery after a worker died, a late consume)."""
        if self.stopping:
            await Settlement(message, self._acks)("nack", requeue=True)
            return
        self._acks.received(message)
        try:
            msg = decode(message.body)
        except MalformedMessage:
            self._run(message, self._handle(message, None))  # dead-lettered by the usual path
            return
        if msg.start_at is None or msg.start_at <= self._clock.now():
            self._run(message, self._handle_staged(message, msg, timed=False))
        else:
            self._staged.hold((message, msg), msg.start_at)

    def _start_staged(self, item: tuple[AbstractIncomingMessage, JobMessage]) -> None:
        """A staged delivery's run time came: it goes the way of any delivery."""
        message, msg = item
        self._run(message, self._handle_staged(message, msg, timed=True))

    async def _give_back_staged(self) -> None:
        """Stopping: the staged deliveries held go back to the broker at once, for
        another worker to start on time."""
        held = await self._staged.close()
        for message, _ in held:
            await Settlement(message, self._acks)("nack", requeue=True)
        if held:
            STAGED_RELEASED.labels("requeued").inc(len(held))
            log.info("staged_given_back", count=len(held))

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[HandlerSlot]:
        """A handler slot for this delivery (``workers.slots``), taken by the executor
        when the handler is about to start and given back when it returned. From the
        first time it held one, the delivery is *running* (drained with the grace
        period, not nacked as waiting) until it is settled."""
        task = asyncio.current_task()
        assert task is not None

        def changed(change: int) -> None:
            self._running.add(task)
            self._count_active(change)

        slot = HandlerSlot(self._slots, changed)
        try:
            yield slot
        finally:
            slot.release()
            self._running.discard(task)

    def _count_active(self, change: int) -> None:
        self.active += change
        self.peak = max(self.peak, self.active)
        HANDLERS_RUNNING.inc(change)

    async def _handle(self, message: AbstractIncomingMessage, msg: JobMessage | None) -> None:
        settle = Settlement(message, self._acks)
        job: dict[str, Any] = {}  # job_id/attempt/task for log lines, once decoded
        committed = False
        try:
            try:
                msg = decode(message.body) if msg is None else msg
            except MalformedMessage as exc:
                MALFORMED_MESSAGES.inc()
                log.error("message_malformed", error=str(exc), **_delivery(message))
                await settle("reject", requeue=False)  # to the dead-letter queue
                return
            job = {"job_id": msg.job_id, "attempt": msg.attempt, "task": msg.task}
            executor = self._executor
            if isinstance(executor, ShardExecutors) and msg.shard not in executor:
                raise UnknownShard(msg.shard, executor.names)
            async with self._slot() as slot:
                if self.stopping:
                    await settle("nack", requeue=True)
                    return
                await self._executor.execute(msg, redelivered=bool(message.redelivered), slot=slot)
                committed = True
            self._db_failures = 0
            outage = self._outages.get(msg.shard)
            if outage is not None:
                outage.committed()
            await settle("ack")
        except asyncio.CancelledError:
            # an outcome already committed is acked; anything else goes back to the queue
            await (settle("ack") if committed else settle("nack", requeue=True))
            raise
        except DatabaseUnavailable as exc:
            assert msg is not None  # raised by the executor: the body was decoded
            await self._requeue_later(settle, exc, job, shard=msg.shard)
        except AttemptRunningElsewhere as exc:
            await self._requeue_later(settle, exc, job, delay=RUNNING_ELSEWHERE_REQUEUE)
        except UnknownShard as exc:
            await self._unknown_shard(settle, exc, job)
        except Exception as exc:  # a bug: never crash the consumer, never lose the message
            log.exception("delivery_failed", message_id=message.message_id, **job)
            await self._requeue_later(settle, exc, job)

    async def _unknown_shard(
        self, settle: Settlement, exc: UnknownShard, job: dict[str, Any]
    ) -> None:
        """Requeue at once for another worker, or dead-letter after
        ``UNKNOWN_SHARD_DELIVERIES`` deliveries (module docstring)."""
        deliveries = _delivery_count(settle.message) + 1
        dead_letter = deliveries >= UNKNOWN_SHARD_DELIVERIES
        log.error(
            "delivery_unknown_shard",
            message_id=settle.message.message_id,
            shard=exc.shard,
            worker_shards=list(exc.known),
            deliveries=deliveries,
            action="dead-lettered" if dead_letter else "requeued for another worker",
            **job,
        )
        if dead_letter:
            DELIVERIES_DROPPED.labels(exc.shard, "unknown_shard").inc()
            await settle("reject", requeue=False)
        else:
            self.requeued += 1
            DELIVERIES_REQUEUED.inc()
            await settle("nack", requeue=True)

    def _outage(self, shard: str) -> Outage:
        outage = self._outages.get(shard)
        if outage is None:
            outage = self._outages[shard] = Outage(
                lambda: self._executor.ping(shard),
                cap=self._db_retry_cap,
                probe_timeout=self._timeout,
                shard=shard,
                clock=self._clock,
            )
        return outage

    async def _requeue_later(
        self,
        settle: Settlement,
        exc: BaseException,
        job: dict[str, Any],
        *,
        delay: float | None = None,
        shard: str | None = None,
    ) -> None:
        """Nack with requeue after ``delay``; for a delivery that could not reach its
        database (``shard``), once that database answers again, or after
        ``db_retry_cap`` seconds (``workers.outage``); otherwise after a delay growing
        with the consecutive failures (a bug in the delivery path: never a hot loop).
        Logged once it goes back, with the seconds it waited."""
        outage = self._outage(shard) if shard is not None else None
        if outage is None and delay is None:
            self._db_failures += 1
            delay = bounded_jitter(self._db_failures, base=DB_RETRY_BASE, cap=self._db_retry_cap)
        self.requeued += 1
        DELIVERIES_REQUEUED.inc()
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            if not self.stopping:
                await (outage.wait() if outage is not None else asyncio.sleep(delay or 0.0))
        finally:  # cancelled by shutdown too: back to the queue either way
            await settle("nack", requeue=True)
        log.warning(
            "delivery_requeued",
            message_id=settle.message.message_id,
            reason=f"{type(exc).__name__}: {exc}",
            consecutive_failures=outage.failures if outage is not None else self._db_failures,
            waited=round(loop.time() - started, 3),
            **job,
        )


def _delivery_count(message: AbstractIncomingMessage) -> int:
    """Earlier deliveries of this message: the quorum queue's ``x-delivery-count``; a
    queue that does not count gives only the ``redelivered`` flag (0 or 1)."""
    count = (message.headers or {}).get("x-delivery-count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count
    return 1 if message.redelivered else 0


def _delivery(message: AbstractIncomingMessage) -> dict[str, Any]:
    """Which delivery a log line is about when its body says nothing usable."""
    return {
        "message_id": message.message_id,
        "queue": message.routing_key,
        "redelivered": message.redelivered,
    }
