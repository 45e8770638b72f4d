"""Publishing job messages to RabbitMQ with confirms, many in flight (DESIGN §5).

A ``Publisher`` owns one robust connection and one channel opened with publisher
confirms and ``on_return_raises=True``; every message goes through the default
exchange with ``mandatory=True``, so each publish ends in exactly one of:

- **confirmed** — the broker acked it: the message is in a durable quorum queue;
- **nack** — the broker refused it (``DeliveryError``);
- **returned** — no queue took it, e.g. the queue was deleted under us
  (``PublishError``); the queue is forgotten and re-declared before the next publish;
- **timeout** — no answer within the batch deadline (the message may still arrive);
- **connection** — the channel or connection went away while it was in flight.

Only confirmed jobs may be marked dispatched. A job in any other outcome stays pending
and is claimed again; if its message did reach a queue after all, the worker's ledger
absorbs the duplicate (at-least-once, DESIGN §1.2).

Throughput comes from having a whole batch in flight: awaiting each confirm in turn caps
at ~1k msg/s, a batch of 500 outstanding publishes at several thousand. The batch shares
one deadline (``publish_timeout``), which also bounds how long the dispatcher's claim
transaction, and any worker waiting on its row locks, can last.

Backpressure: ``throttle_delay()`` is how long the caller should wait before the next
batch — non-zero while RabbitMQ has blocked the connection (a resource alarm:
publishes would only sit in socket buffers and time out) or while recent batches came
close to the deadline (publish latency growing). aio-pika does not expose
``connection.blocked``/``unblocked`` as callbacks; aiormq tracks them in a private
event, read here defensively (absent in another aiormq version → latency alone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import aiormq
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from scheduler import broker, tracing
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.config.shards import DEFAULT_SHARD
from scheduler.errors import DuetimeError
from scheduler.log import get_logger
from scheduler.messages import JobMessage, encode_job
from scheduler.store.rows import ClaimedJob

log = get_logger(__name__)

DEFAULT_PUBLISH_TIMEOUT = 5.0
DEFAULT_RECONNECT_INTERVAL = 1.0
#: A batch that used more than this share of ``publish_timeout`` counts as slow.
SLOW_BATCH_FRACTION = 0.5
#: Longest pause ``throttle_delay`` asks for because of latency.
MAX_THROTTLE = 2.0
#: How often a caller re-checks a blocked connection.
BLOCKED_RECHECK = 0.25

OUTCOMES = ("nack", "returned", "timeout", "connection", "declare", "error")


@dataclass(frozen=True, slots=True)
class PublishFailure:
    job: ClaimedJob
    reason: str  # one of OUTCOMES
    detail: str


@dataclass(frozen=True, slots=True)
class QueueState:
    """What a passive declare says of a job queue."""

    ready: int  # messages no consumer holds yet
    consumers: int


@dataclass(slots=True)
class PublishResult:
    confirmed: list[ClaimedJob] = field(default_factory=list)
    failed: list[PublishFailure] = field(default_factory=list)
    seconds: float = 0.0

    def failures_by_reason(self) -> dict[tuple[str, str], list[int]]:
        """{(reason, queue): [job ids]} — what error logs report."""
        groups: dict[tuple[str, str], list[int]] = {}
        for failure in self.failed:
            groups.setdefault((failure.reason, failure.job.queue), []).append(failure.job.id)
        return groups


def publish_timeout_for(settings: Settings) -> float:
    """The batch deadline for a scheduler: at most ``DEFAULT_PUBLISH_TIMEOUT``, the AMQP
    timeout, and half the lease TTL. The claim transaction is idle while it waits for
    confirms, and the replica sets ``idle_in_transaction_session_timeout`` to about one
    TTL: a batch must finish well before PostgreSQL would end the session."""
    return min(DEFAULT_PUBLISH_TIMEOUT, settings.amqp_timeout, settings.lease_ttl / 2)


def _classify(exc: BaseException) -> str:
    if isinstance(exc, aiormq.exceptions.PublishError):
        return "returned"
    if isinstance(exc, aiormq.exceptions.DeliveryError):
        return "nack"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, asyncio.CancelledError):  # a confirm future cancelled by a closing channel
        return "connection"
    if isinstance(
        exc,
        aiormq.exceptions.AMQPError
        | aiormq.exceptions.ChannelInvalidStateError
        | ConnectionError
        | OSError,
    ):
        return "connection"
    return "error"


@dataclass(eq=False)
class Publisher:
    """One confirmed channel, the queues declared on it, and the latency it sees."""

    url: str
    _: KW_ONLY
    delivery_limit: int
    publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT
    connect_timeout: float = 10.0
    reconnect_interval: float = DEFAULT_RECONNECT_INTERVAL
    name: str = "duetime-publisher"
    #: The shard whose database holds the rows this publisher announces (the message
    #: names it, so a worker runs the delivery against that shard).
    shard: str = DEFAULT_SHARD
    #: Times the back-pressure pause and each batch (a batch's confirm deadline is the
    #: event loop's, since it bounds real waits).
    clock: Clock = SYSTEM_CLOCK
    _connection: AbstractRobustConnection | None = field(default=None, init=False, repr=False)
    _channel: AbstractChannel | None = field(default=None, init=False, repr=False)
    _declared: set[str] = field(default_factory=set, init=False, repr=False)
    _pressure: float = field(default=0.0, init=False, repr=False)  # EWMA: batch / timeout
    #: monotonic time before which the next batch should wait
    _pause_until: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.publish_timeout <= 0:
            raise ValueError("publish_timeout must be > 0")

    @classmethod
    def from_settings(cls, settings: Settings, *, name: str, **overrides: Any) -> Publisher:
        kwargs: dict[str, Any] = {
            "delivery_limit": settings.delivery_limit,
            "publish_timeout": publish_timeout_for(settings),
            "connect_timeout": settings.amqp_timeout,
            "name": f"{name}:{settings.node_id}",
        }
        kwargs.update(overrides)
        return cls(settings.amqp_url, **kwargs)

    # -- lifecycle -------------------------------------------------------------------

    async def open(self) -> Publisher:
        if self._connection is not None:
            return self
        connection = await broker.connect(
            self.url,
            timeout=self.connect_timeout,
            name=self.name,
            reconnect_interval=self.reconnect_interval,
        )
        try:
            channel = connection.channel(publisher_confirms=True, on_return_raises=True)
            await asyncio.wait_for(channel.initialize(), self.connect_timeout)
        except BaseException:
            await broker.close_connection(connection, broker.CLOSE_TIMEOUT)
            raise
        self._connection, self._channel = connection, channel
        return self

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        self._declared.clear()
        if connection is not None:  # bounded, never raises: teardown must not fail on it
            await broker.close_connection(connection, broker.CLOSE_TIMEOUT)

    async def __aenter__(self) -> Publisher:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def channel(self) -> AbstractChannel:
        if self._channel is None:
            raise RuntimeError("publisher is not open")
        return self._channel

    # -- state -----------------------------------------------------------------------

    @property
    def blocked(self) -> bool:
        """True while RabbitMQ has blocked this connection (memory/disk alarm)."""
        connection = self._connection
        transport = getattr(connection, "transport", None) if connection else None
        underlay = getattr(transport, "connection", None)
        unblocked = getattr(underlay, "_Connection__connection_unblocked", None)
        return isinstance(unblocked, asyncio.Event) and not unblocked.is_set()

    @property
    def is_ready(self) -> bool:
        return self._channel is not None and not self._channel.is_closed

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the channel to be usable (after a reconnect)."""
        if self._channel is None:
            return False
        if not self._channel.is_closed:
            return True
        ready = getattr(self._channel, "ready", None)
        if ready is None:
            return False
        try:
            await asyncio.wait_for(ready(), timeout)
        except TimeoutError:
            return False
        return not self._channel.is_closed

    @property
    def pressure(self) -> float:
        """Recent batch time as a share of ``publish_timeout`` (smoothed)."""
        return self._pressure

    def throttle_delay(self) -> float:
        """Seconds to wait before publishing the next batch (0: go ahead).

        A slow batch buys a pause about as long as the batch took (so under pressure at
        most half the time is spent publishing); the next batch after the pause measures
        again. A blocked connection is re-checked every ``BLOCKED_RECHECK`` seconds.
        """
        if self.blocked:
            return BLOCKED_RECHECK
        return max(0.0, self._pause_until - self.clock.monotonic())

    def _record(self, seconds: float, timed_out: bool) -> None:
        if timed_out:  # the deadline was hit: back off at once
            self._pressure = 1.0
        else:
            self._pressure = 0.5 * self._pressure + 0.5 * seconds / self.publish_timeout
        if self._pressure > SLOW_BATCH_FRACTION:
            pause = min(MAX_THROTTLE, self._pressure * self.publish_timeout)
            self._pause_until = self.clock.monotonic() + pause

    # -- topology --------------------------------------------------------------------

    async def ensure_queue(self, queue: str, *, staged: bool = False) -> None:
        """Declare ``duetime.<queue>`` (``staged``: its staged twin) once per publisher
        (until it is forgotten)."""
        key = broker.staged_queue_name(queue) if staged else queue
        if key in self._declared:
            return
        await asyncio.wait_for(
            broker.declare_job_queue(
                self.channel, queue, delivery_limit=self.delivery_limit, staged=staged
            ),
            self.connect_timeout,
        )
        self._declared.add(key)

    def forget_queue(self, queue: str) -> None:
        """Re-declare ``queue`` (and its staged twin) before its next publish (it was
        deleted or returned)."""
        self._declared.discard(queue)
        self._declared.discard(broker.staged_queue_name(queue))

    async def ready_messages(self, queue: str) -> int | None:
        """Messages waiting in ``duetime.<queue>`` (declares it); None when unknown."""
        try:
            underlay = await asyncio.wait_for(
                self.channel.get_underlay_channel(), self.connect_timeout
            )
            ok = await underlay.queue_declare(
                broker.queue_name(queue),
                durable=True,
                arguments=broker.job_queue_arguments(self.delivery_limit),
                timeout=self.connect_timeout,
            )
        except (aiormq.exceptions.AMQPError, TimeoutError, ConnectionError, RuntimeError) as exc:
            log.warning("queue_depth_unknown", queue=queue, error=repr(exc))
            await self.wait_ready(self.connect_timeout)  # a refused declare closed the channel
            return None
        count = getattr(ok, "message_count", None)
        return int(count) if count is not None else None

    async def queue_state(
        self, queue: str, timeout: float, *, staged: bool = False
    ) -> QueueState | None:
        """Ready messages and consumers of ``duetime.<queue>`` from a passive declare
        (creates nothing; one round trip on this channel); None when it failed or took
        longer than ``timeout``. A queue that no longer exists closes the channel
        (404): it is forgotten, so the next publish declares it again, and the robust
        channel reopens (waited for here, within ``timeout``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with asyncio.timeout_at(deadline):
                underlay = await self.channel.get_underlay_channel()
                name = broker.staged_queue_name(queue) if staged else broker.queue_name(queue)
                ok = await underlay.queue_declare(name, passive=True)
        except (aiormq.exceptions.AMQPError, TimeoutError, ConnectionError, RuntimeError) as exc:
            log.warning("queue_state_unknown", queue=queue, error=repr(exc))
            self.forget_queue(queue)
            await self.wait_ready(max(0.0, deadline - loop.time()))
            return None
        ready, consumers = getattr(ok, "message_count", None), getattr(ok, "consumer_count", None)
        if ready is None or consumers is None:
            return None
        return QueueState(int(ready), int(consumers))

    # -- publishing ------------------------------------------------------------------

    async def publish(
        self, jobs: Sequence[ClaimedJob], epoch: int, *, staged: bool = False
    ) -> PublishResult:
        """Publish every job with its confirm in flight at once; report each outcome.
        ``staged``: to the queues' staged twins, each message carrying its job's run time
        (``start_at``, DESIGN §14).

        Never raises for a per-message failure: the result says which jobs were
        confirmed and why the others were not. One span per batch when the application
        traces (``scheduler.tracing``).
        """
        if not jobs:
            return PublishResult()
        queues = sorted({broker.QUEUE_PREFIX + job.queue for job in jobs})
        with tracing.publish_span(queues, len(jobs)):
            return await self._publish(jobs, epoch, staged)

    async def _publish(
        self, jobs: Sequence[ClaimedJob], epoch: int, staged: bool = False
    ) -> PublishResult:
        result = PublishResult()
        started = self.clock.monotonic()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.publish_timeout

        sendable: list[ClaimedJob] = []
        broken: dict[str, str] = {}
        for queue in sorted({job.queue for job in jobs}):
            try:
                await self.ensure_queue(queue, staged=staged)
            except (DuetimeError, aiormq.exceptions.AMQPError, TimeoutError, RuntimeError) as exc:
                broken[queue] = f"{type(exc).__name__}: {exc}"
                # RabbitMQ closes the channel on a refused declare; the robust channel
                # reopens it, and nothing else may use it before that
                await self.wait_ready(max(0.0, deadline - loop.time()))
        for job in jobs:
            if job.queue in broken:
                result.failed.append(PublishFailure(job, "declare", broken[job.queue]))
            else:
                sendable.append(job)

        try:
            underlay = await asyncio.wait_for(
                self.channel.get_underlay_channel(), max(0.001, deadline - loop.time())
            )
        except (aiormq.exceptions.AMQPError, TimeoutError, ConnectionError, RuntimeError) as exc:
            detail = f"{type(exc).__name__}: {exc}"
            result.failed.extend(PublishFailure(job, _classify(exc), detail) for job in sendable)
            sendable = []
            underlay = None

        outcomes = await asyncio.gather(
            *(self._publish_one(underlay, job, epoch, deadline, staged) for job in sendable),
            return_exceptions=True,
        )
        returned: set[str] = set()
        for job, outcome in zip(sendable, outcomes, strict=True):
            if not isinstance(outcome, BaseException):
                result.confirmed.append(job)
                continue
            reason = _classify(outcome)
            if reason == "returned":
                returned.add(job.queue)
            result.failed.append(
                PublishFailure(job, reason, f"{type(outcome).__name__}: {outcome}")
            )
        for queue in returned:
            self.forget_queue(queue)
        if not result.confirmed and any(f.reason == "nack" for f in result.failed):
            await self._renew_channel()
        result.seconds = self.clock.monotonic() - started
        self._record(result.seconds, any(f.reason == "timeout" for f in result.failed))
        return result

    async def _renew_channel(self) -> None:
        """Replace a channel whose every publish the broker refused (nack) by a new one.

        A channel of RabbitMQ 3.10 that first publishes to a quorum queue while the
        queue's record still names a dead leader keeps nacking that queue for good
        (RabbitMQ 3.11.x/3.12.x ask Ra for the leader instead, rabbitmq-server#9241):
        after the node leading a queue dies, the jobs of every batch would stay pending
        forever. A fresh channel looks the leader up again.
        """
        connection, old = self._connection, self._channel
        if connection is None:
            return
        try:
            channel = connection.channel(publisher_confirms=True, on_return_raises=True)
            await asyncio.wait_for(channel.initialize(), self.connect_timeout)
        except (aiormq.exceptions.AMQPError, TimeoutError, ConnectionError, RuntimeError) as exc:
            log.warning("publisher_channel_renew_failed", error=repr(exc))
            return
        self._channel = channel
        self._declared.clear()
        log.info("publisher_channel_renewed", reason="every publish of a batch was nacked")
        if old is not None:
            try:
                await asyncio.wait_for(old.close(), self.connect_timeout)
            except Exception as exc:  # the refused channel is being dropped anyway
                log.debug("publisher_old_channel_close_failed", error=repr(exc))

    async def _publish_one(
        self, channel: Any, job: ClaimedJob, epoch: int, deadline: float, staged: bool = False
    ) -> None:
        """Publish one job and wait for its confirm; raises what went wrong.

        Straight on the aiormq channel with ``wait=False``: aio-pika's
        ``Exchange.publish`` holds the channel lock until each frame is written, which
        serialises a batch; here frames queue up at once and only confirms are awaited
        (measured ~15 % more msgs/s with 500 in flight).
        """
        message = JobMessage(
            job_id=job.id,
            due_at=job.due_at,
            attempt=job.attempt,
            epoch=epoch,
            task=job.task,
            shard=self.shard,
            start_at=(job.run_at or job.due_at) if staged else None,
        )
        body, properties = encode_job(message)
        name = broker.staged_queue_name(job.queue) if staged else broker.queue_name(job.queue)
        async with asyncio.timeout_at(deadline):
            await channel.basic_publish(
                body,
                exchange="",
                routing_key=name,
                properties=properties,
                mandatory=True,
                wait=False,
            )
