"""The broker side of a worker: deliveries in, acks out, at most N handlers at once.

Each delivery becomes one asyncio task owned by the ``Consumer`` (aio-pika's own
callback task only hands it over). A semaphore of size ``concurrency`` bounds the
handlers running at once; prefetch is set to the same N per queue, so with several
queues a few deliveries may wait for a slot, unacked, which is harmless.

Settlement rules (DESIGN §6):

- ack only after the ledger committed an outcome (``Ledger.execute`` returned);
- a body that is not a job (``MalformedMessage``) → ``reject(requeue=False)``: the
  queue's dead-letter exchange moves it to ``duetime.dead-letter``; counted and logged
  with its ``message_id``;
- no outcome could be recorded (``DatabaseUnavailable``) → nack with requeue after a
  bounded, jittered delay growing with consecutive failures, so a database outage does
  not become a hot redelivery loop. Past the queue's delivery limit RabbitMQ
  dead-letters the message; the job row is still ``dispatched`` and the reconciler
  publishes it again after the visibility timeout, so nothing is lost;
- shutdown: deliveries waiting for a slot are nacked with requeue at once; running ones
  get the grace period, then are cancelled (their transaction rolls back) and nacked.

An ack that fails (channel closed by a broker reconnect) is only logged: the broker
redelivers the message and the ledger recognises it as already settled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from scheduler.backoff import bounded_jitter
from scheduler.broker import declare_job_queue
from scheduler.log import get_logger
from scheduler.messages import MalformedMessage, decode
from scheduler.metrics import DELIVERIES_REQUEUED, MALFORMED_MESSAGES
from workers.ledger import DatabaseUnavailable, Ledger

log = get_logger("duetime.worker")

DB_RETRY_BASE = 0.5
DB_RETRY_CAP = 10.0


class Consumer:
    """Consumes job queues on one channel and runs each delivery through the ledger."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        concurrency: int,
        timeout: float = 10.0,
        db_retry_cap: float = DB_RETRY_CAP,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (got {concurrency})")
        self._ledger = ledger
        self.concurrency = concurrency
        self._timeout = timeout
        self._db_retry_cap = db_retry_cap
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: set[asyncio.Task[None]] = set()
        self._consumers: list[tuple[AbstractQueue, str]] = []
        self._db_failures = 0
        self.stopping = False
        self.active = 0  # deliveries holding a slot right now
        self.peak = 0  # most deliveries ever holding a slot at once
        self.requeued = 0  # deliveries nacked back because no outcome could be recorded

    @property
    def in_flight(self) -> int:
        """Deliveries received and not yet settled."""
        return len(self._tasks)

    async def start(
        self, channel: AbstractChannel, queues: Sequence[str], *, delivery_limit: int
    ) -> None:
        """Declare the queues, set prefetch = concurrency, and start consuming."""
        await channel.set_qos(prefetch_count=self.concurrency, timeout=self._timeout)
        for name in queues:
            queue = await declare_job_queue(channel, name, delivery_limit=delivery_limit)
            tag = await queue.consume(self._on_message, no_ack=False, timeout=self._timeout)
            self._consumers.append((queue, tag))

    async def stop_consuming(self) -> None:
        """Cancel the broker consumers (no new deliveries); safe twice."""
        self.stopping = True
        consumers, self._consumers = self._consumers, []
        for queue, tag in consumers:
            try:
                # bounded as a whole: a robust channel may wait to be reconnected first
                await asyncio.wait_for(queue.cancel(tag, timeout=self._timeout), self._timeout)
            except Exception as exc:  # channel already gone: nothing will arrive anyway
                log.warning("consumer_cancel_failed", queue=queue.name, error=repr(exc))
        if consumers:
            log.info("consuming_stopped", queues=[q.name for q, _ in consumers])

    async def drain(self, grace: float) -> int:
        """Stop: nack waiting deliveries, give running ones ``grace`` seconds, cancel the
        rest. Returns how many running deliveries had to be cancelled."""
        await self.stop_consuming()
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
        return len(pending)

    async def abort(self) -> None:
        """A start that failed half-way: cancel whatever deliveries already began (their
        transactions roll back; the broker requeues them when the channel closes)."""
        self.stopping = True
        self._consumers = []
        for task in list(self._tasks):
            task.cancel()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- deliveries ------------------------------------------------------------------

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        if self.stopping:  # arrived between our cancel and the broker's CancelOk
            await _Settlement(message)("nack", requeue=True)
            return
        task = asyncio.create_task(self._handle(message), name=f"delivery:{message.message_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        task = asyncio.current_task()
        assert task is not None
        async with self._slots:
            self._running.add(task)
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                yield
            finally:
                self.active -= 1
                self._running.discard(task)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        settle = _Settlement(message)
        job: dict[str, Any] = {}  # job_id/attempt/task for log lines, once decoded
        committed = False
        try:
            try:
                msg = decode(message.body)
            except MalformedMessage as exc:
                MALFORMED_MESSAGES.inc()
                log.error(
                    "message_malformed",
                    message_id=message.message_id,
                    queue=message.routing_key,
                    redelivered=message.redelivered,
                    error=str(exc),
                )
                await settle("reject", requeue=False)
                return
            job = {"job_id": msg.job_id, "attempt": msg.attempt, "task": msg.task}
            async with self._slot():
                if self.stopping:
                    await settle("nack", requeue=True)
                    return
                await self._ledger.execute(msg)
                committed = True
            self._db_failures = 0
            await settle("ack")
        except asyncio.CancelledError:
            # an outcome already committed is acked; anything else goes back to the queue
            await (settle("ack") if committed else settle("nack", requeue=True))
            raise
        except DatabaseUnavailable as exc:
            await self._requeue_later(settle, exc, job)
        except Exception as exc:  # a bug: never crash the consumer, never lose the message
            log.exception("delivery_failed", message_id=message.message_id, **job)
            await self._requeue_later(settle, exc, job)

    async def _requeue_later(
        self, settle: _Settlement, exc: BaseException, job: dict[str, Any]
    ) -> None:
        self._db_failures += 1
        self.requeued += 1
        DELIVERIES_REQUEUED.inc()
        delay = bounded_jitter(self._db_failures, base=DB_RETRY_BASE, cap=self._db_retry_cap)
        log.warning(
            "delivery_requeued",
            message_id=settle.message.message_id,
            reason=f"{type(exc).__name__}: {exc}",
            consecutive_failures=self._db_failures,
            requeue_in=round(delay, 3),
            **job,
        )
        try:
            if not self.stopping:
                await asyncio.sleep(delay)
        finally:  # cancelled by shutdown too: back to the queue either way
            await settle("nack", requeue=True)


class _Settlement:
    """Settles one delivery (ack, nack or reject) exactly once.

    Marked done *before* the frame is sent: a cancellation that lands while aio-pika
    waits for the write to drain must not make us send a second, conflicting frame for
    the same delivery tag (RabbitMQ closes the channel on that). A failure to send
    (channel gone after a broker reconnect) is logged, not raised: the broker redelivers
    and the ledger recognises the delivery as settled.
    """

    __slots__ = ("done", "message")

    def __init__(self, message: AbstractIncomingMessage) -> None:
        self.message = message
        self.done = False

    async def __call__(self, action: str, **kwargs: Any) -> None:
        if self.done or self.message.processed:
            return
        self.done = True
        try:
            await getattr(self.message, action)(**kwargs)
        except Exception as exc:
            log.warning(
                "settle_failed",
                action=action,
                message_id=self.message.message_id,
                error=repr(exc),
            )
