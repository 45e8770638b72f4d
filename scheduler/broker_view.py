"""What RabbitMQ says about the job queues, for ``duetime status`` and the dashboard.

A passive ``queue.declare`` per job queue answers with its ready-message and consumer
counts without the management plugin (which a deployment may not expose), and never
creates a queue. All on one connection (the first node of the cluster that answers).
Unacknowledged messages are not in that answer; the jobs the database holds as
``dispatched`` are the closest figure (published, not yet finished) and are shown
beside it. A passive declare of a missing queue closes the channel, so each queue gets
its own channel; the whole read has a deadline so a slow broker cannot hold a page.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import aio_pika

from scheduler.broker import amqp_urls, queue_name
from scheduler.config import Settings
from scheduler.log import scrub

__all__ = ["BrokerView", "QueueDepth", "read_broker"]


@dataclass(frozen=True, slots=True)
class QueueDepth:
    queue: str
    ready: int | None  # None: the queue does not exist (yet)
    consumers: int | None


@dataclass(frozen=True, slots=True)
class BrokerView:
    reachable: bool
    queues: tuple[QueueDepth, ...] = ()
    error: str | None = None

    def consumers(self, queue: str) -> int | None:
        """Consumers of ``queue`` (0 when its broker queue does not exist); None when the
        queue was not read."""
        for depth in self.queues:
            if depth.queue == queue:
                return depth.consumers or 0
        return None


async def read_broker(
    settings: Settings, queues: Iterable[str], timeout: float = 3.0
) -> BrokerView:
    """Connect, then read every queue of ``queues``; unreachable (with the error) when
    that fails or the whole read outlives ``timeout``. Never raises."""
    try:
        async with asyncio.timeout(timeout):
            connection = await _connect_any(amqp_urls(settings.amqp_url), timeout)
            try:
                depths = [await _depth(connection, q) for q in sorted(set(queues))]
            finally:
                with contextlib.suppress(Exception):
                    await connection.close()
    except Exception as exc:  # OSError, AMQP errors, TimeoutError: shown, never raised
        detail = str(exc) or f"no answer within {timeout:g}s"
        return BrokerView(False, error=scrub(f"{type(exc).__name__}: {detail}")[:300])
    return BrokerView(True, tuple(depths))


async def _connect_any(urls: tuple[str, ...], timeout: float) -> aio_pika.abc.AbstractConnection:
    """The first node of the cluster that answers (the last node's error if none)."""
    for url in urls[:-1]:
        with contextlib.suppress(OSError, aio_pika.exceptions.AMQPError):
            return await aio_pika.connect(
                url, timeout=timeout, client_properties={"connection_name": "duetime-status"}
            )
    return await aio_pika.connect(
        urls[-1], timeout=timeout, client_properties={"connection_name": "duetime-status"}
    )


async def _depth(connection: aio_pika.abc.AbstractConnection, queue: str) -> QueueDepth:
    channel = await connection.channel()
    try:
        declared = await channel.declare_queue(queue_name(queue), passive=True)
    except aio_pika.exceptions.ChannelClosed:
        return QueueDepth(queue, None, None)
    result = declared.declaration_result
    with contextlib.suppress(Exception):
        await channel.close()
    return QueueDepth(queue, result.message_count, result.consumer_count)
