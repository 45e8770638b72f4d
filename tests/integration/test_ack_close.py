"""A stop sends the acks already queued before the channel closes.

A stop cancels the deliveries that are not running; one cancelled while its ack waited
in the ``AckCoalescer`` leaves the frame to a flush. Were the channel closed under that
flush, the broker would redeliver jobs whose outcome is already committed (CI caught a
stop under a burst of acks doing so, with an error on the connection).
"""

from __future__ import annotations

import asyncio

import aio_pika
import pytest

from workers.acks import AckCoalescer

pytestmark = pytest.mark.timeout(60)

MESSAGES = 300


async def test_acks_queued_by_cancelled_deliveries_are_sent_before_the_channel_closes(
    amqp_url: str, unique: str
) -> None:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=MESSAGES)
        queue = await channel.declare_queue(f"acks-{unique}", durable=False)
        try:
            for i in range(MESSAGES):
                await channel.default_exchange.publish(
                    aio_pika.Message(str(i).encode()), routing_key=queue.name
                )
            received: list[aio_pika.abc.AbstractIncomingMessage] = []
            all_in = asyncio.Event()

            async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                received.append(message)
                if len(received) == MESSAGES:
                    all_in.set()

            await queue.consume(on_message)
            await asyncio.wait_for(all_in.wait(), 10)

            acks = AckCoalescer()
            for message in received:
                acks.received(message)
            # the first stays unsettled: the others are above it, one ack frame each
            waiting = [asyncio.create_task(acks.ack(m)) for m in received[1:]]
            await asyncio.sleep(0)
            await asyncio.sleep(0)  # the flush has begun
            for task in waiting:
                task.cancel()  # as a stop cancels deliveries that are not running
            await acks.close(5.0)
            await channel.close()  # unacked deliveries go back to the queue

            check = await connection.channel()
            left = await check.declare_queue(queue.name, passive=True)
            assert left.declaration_result.message_count == 1  # only the one never acked
            assert acks.frames == MESSAGES - 1
        finally:
            cleanup = await connection.channel()
            await cleanup.queue_delete(queue.name)
