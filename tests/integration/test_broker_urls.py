"""``ClusterConnection`` against the machine's RabbitMQ, one ``FaultProxy`` per "node".

Two proxies in front of the same broker stand for two nodes of a cluster: cutting one
and refusing new connections on it is that node dying. Fast and in-process; the real
3-node cluster is tests/chaos/test_rabbit_cluster.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aio_pika
import pytest

from scheduler.broker import ClusterConnection, connect, declare_job_queue, queue_name
from scheduler.broker_view import read_broker
from scheduler.config import Settings
from tests.support.proxy import FaultProxy
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(60)

DEAD = "amqp://guest:guest@127.0.0.1:9/"  # nothing listens on the discard port


@pytest.fixture
async def proxies(amqp_url: str) -> AsyncIterator[tuple[FaultProxy, FaultProxy]]:
    parts = urlsplit(amqp_url)
    first = await FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5672).start()
    second = await FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5672).start()
    try:
        yield first, second
    finally:
        await first.stop()
        await second.stop()


async def _publish(connection: aio_pika.abc.AbstractConnection, queue: str) -> None:
    channel = await connection.channel()
    try:
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}"), routing_key=queue_name(queue), mandatory=True
        )
    finally:
        await channel.close()


async def test_opens_on_the_first_node_that_answers(amqp_url: str) -> None:
    connection = await connect(f"{DEAD},{amqp_url}", timeout=5, reconnect_interval=0.2)
    try:
        assert isinstance(connection, ClusterConnection)
        assert str(connection.url.port) == str(urlsplit(amqp_url).port or 5672)
        assert not connection.is_closed
    finally:
        await connection.close()


async def test_moves_to_the_next_node_when_its_node_dies(
    amqp_url: str, proxies: tuple[FaultProxy, FaultProxy], unique: str
) -> None:
    first, second = proxies
    urls = f"{first.route(amqp_url)},{second.route(amqp_url)}"
    connection = await connect(urls, timeout=5, name=f"test-{unique}", reconnect_interval=0.2)
    try:
        channel = await connection.channel()
        queue = await declare_job_queue(channel, f"urls-{unique}", delivery_limit=20)
        await _publish(connection, f"urls-{unique}")
        assert first.connections == 1 and second.connections == 0

        first.refuse(True)  # the node is gone: its connections drop, new ones fail
        assert first.cut() == 1

        async def on_second() -> bool:
            return second.connections == 1 and not connection.is_closed

        await wait_for(on_second, timeout=10, message="the connection on the second node")
        await asyncio.wait_for(channel.ready(), 10)  # type: ignore[attr-defined]
        await _publish(connection, f"urls-{unique}")  # confirmed, through the second node
        got = [await queue.get(no_ack=True, timeout=5) for _ in range(2)]
        assert [m.body for m in got] == [b"{}", b"{}"]

        first.heal()  # back, but a connection stays where it is until its node goes
        second.refuse(True)
        second.cut()

        async def back_on_first() -> bool:
            return first.connections == 1 and second.connections == 0

        await wait_for(back_on_first, timeout=10, message="the connection back on the first")
        await channel.queue_delete(queue.name)
    finally:
        await connection.close()


async def test_dashboard_reads_the_broker_past_a_dead_node(
    settings: Settings, amqp_url: str, unique: str
) -> None:
    view = await read_broker(
        dataclasses.replace(settings, amqp_url=f"{DEAD},{amqp_url}"), [f"none-{unique}"]
    )
    assert view.reachable, view.error
    assert view.queues[0].ready is None  # the queue does not exist: asked, not guessed
