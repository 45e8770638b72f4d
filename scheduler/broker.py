"""RabbitMQ topology and connections, shared by the dispatcher and the workers.

Topology (declared idempotently by whoever connects first):

- one durable **quorum** queue per job queue, named ``duetime.<queue>`` (contract),
  with ``x-delivery-limit`` (a message redelivered that often is poison) and a
  dead-letter exchange;
- ``duetime.dlx`` (fanout) → ``duetime.dead-letter`` (quorum): unparseable messages and
  messages over the delivery limit end up here, visible, never silently dropped.

Publishing goes through the default exchange with ``mandatory=True`` on a channel with
publisher confirms and ``on_return_raises=True``: a message no queue accepts is an
error the dispatcher sees, not a silent return.
"""

from __future__ import annotations

from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractQueue, AbstractRobustConnection

from scheduler.config import redact_url
from scheduler.errors import InvalidInput, ServiceUnavailable
from scheduler.jobspec import validate_queue
from scheduler.startup import is_permanent_cause

QUEUE_PREFIX = "duetime."
DEAD_LETTER_EXCHANGE = "duetime.dlx"
DEAD_LETTER_QUEUE = "duetime.dead-letter"


def queue_name(queue: str) -> str:
    """Broker queue for a job queue: ``duetime.<queue>`` (validated)."""
    return QUEUE_PREFIX + validate_queue(queue)


def job_queue_arguments(delivery_limit: int) -> dict[str, Any]:
    return {
        "x-queue-type": "quorum",
        "x-delivery-limit": delivery_limit,
        "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
    }


async def connect(
    url: str,
    *,
    timeout: float = 10.0,
    name: str = "duetime",
    reconnect_interval: float | None = None,
) -> AbstractRobustConnection:
    """A robust (auto-reconnecting) connection; fails fast with a clear error if the
    broker cannot be reached at all on the first attempt.

    ``reconnect_interval`` (seconds) overrides aio-pika's default of 5 s between
    reconnection attempts (a ``?reconnect_interval=`` in the URL also works).
    """
    extra: dict[str, Any] = {}
    if reconnect_interval is not None:
        extra["reconnect_interval"] = reconnect_interval
    try:
        return await aio_pika.connect_robust(
            url,
            timeout=timeout,
            client_properties={"connection_name": name},
            **extra,
        )
    except (OSError, TimeoutError, aiormq.exceptions.AMQPError) as exc:
        raise ServiceUnavailable(
            f"cannot connect to RabbitMQ at {redact_url(url)}: {type(exc).__name__}: {exc}",
            transient=not is_permanent_cause(exc),
        ) from None


async def declare_dead_letter(channel: AbstractChannel) -> AbstractQueue:
    exchange = await channel.declare_exchange(
        DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )
    queue = await channel.declare_queue(
        DEAD_LETTER_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
    )
    await queue.bind(exchange)
    return queue


async def declare_job_queue(
    channel: AbstractChannel, queue: str, *, delivery_limit: int
) -> AbstractQueue:
    """Declare ``duetime.<queue>`` (and the dead-letter topology).

    A queue that already exists with other arguments makes RabbitMQ close the channel
    (PRECONDITION_FAILED); that is turned into an error saying which queue and why.
    """
    name = queue_name(queue)
    await declare_dead_letter(channel)
    try:
        return await channel.declare_queue(
            name, durable=True, arguments=job_queue_arguments(delivery_limit)
        )
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        raise InvalidInput(
            f"RabbitMQ queue {name} exists with different arguments than duetime needs "
            f"(quorum, x-delivery-limit={delivery_limit}, DLX {DEAD_LETTER_EXCHANGE}): {exc}"
        ) from None
