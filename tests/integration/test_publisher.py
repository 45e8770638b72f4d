"""The publisher (scheduler/publisher.py) against a real RabbitMQ: confirmed batches
carry the contract message; returned, refused and cut-off publishes are reported per
job, never raised and never counted as confirmed; backpressure signals are visible.

No database: the jobs are built in memory (the dispatcher tests cover claiming).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import pytest

from scheduler import broker, messages
from scheduler.config import Settings
from scheduler.publisher import Publisher
from scheduler.store.rows import ClaimedJob
from tests.fixtures_tasks.jobs import drain
from tests.support.helpers import should_throttle
from tests.support.proxy import FaultProxy
from tests.support.wait import wait_for

_ids = itertools.count(1_000_000)


def make_jobs(queue: str, n: int, *, attempt: int = 1) -> list[ClaimedJob]:
    due = datetime.now(UTC).replace(microsecond=123456)
    jobs = []
    for _ in range(n):
        job_id = next(_ids)
        jobs.append(
            ClaimedJob(
                id=job_id,
                task="demo.task",
                queue=queue,
                due_at=due - timedelta(seconds=job_id % 7),
                attempt=attempt,
            )
        )
    return jobs


@pytest.fixture
async def publisher(settings: Settings) -> AsyncIterator[Publisher]:
    pub = Publisher(settings.amqp_url, delivery_limit=settings.delivery_limit, publish_timeout=5)
    await pub.open()
    try:
        yield pub
    finally:
        await pub.close()


async def test_batch_is_confirmed_with_the_contract_message(
    publisher: Publisher, settings: Settings, unique: str
) -> None:
    queue = f"pub-{unique}"
    jobs = make_jobs(queue, 500)
    result = await publisher.publish(jobs, epoch=7)
    assert [j.id for j in result.confirmed] == [j.id for j in jobs]
    assert result.failed == []
    print(f"\n500 confirmed in {result.seconds * 1000:.1f} ms")

    got = await drain(settings.amqp_url, queue, expect=500)
    assert len(got) == 500
    by_id = {job.id: job for job in jobs}
    for message in got:
        body = messages.decode(message.body)
        job = by_id[body.job_id]
        assert message.message_id == f"{job.id}:{job.attempt}"
        assert message.content_type == "application/json"
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert body.epoch == 7
        assert body.due_at == job.due_at
        # a pointer: the worker reads the payload from the row (scheduler/messages.py)
        assert (body.task, body.payload, body.attempt) == (job.task, None, job.attempt)
        assert body.idempotency_key is None  # the worker reads the key from the row
    assert sorted(body_id for body_id in (messages.decode(m.body).job_id for m in got)) == sorted(
        by_id
    )


async def test_queue_deleted_under_the_publisher_is_returned_then_redeclared(
    publisher: Publisher, settings: Settings, unique: str
) -> None:
    queue = f"gone-{unique}"
    first = await publisher.publish(make_jobs(queue, 1), epoch=1)
    assert len(first.confirmed) == 1

    connection = await aio_pika.connect(settings.amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(broker.queue_name(queue))

    jobs = make_jobs(queue, 5)
    result = await publisher.publish(jobs, epoch=1)
    assert result.confirmed == []
    assert {f.reason for f in result.failed} == {"returned"}
    assert "NO_ROUTE" in result.failed[0].detail
    assert result.failures_by_reason() == {("returned", queue): [j.id for j in jobs]}

    again = await publisher.publish(jobs, epoch=1)  # re-declares the queue first
    assert [j.id for j in again.confirmed] == [j.id for j in jobs]
    got = await drain(settings.amqp_url, queue, expect=5)  # the first went with the queue
    assert len(got) == 5


async def test_queue_with_foreign_arguments_fails_only_its_jobs(
    publisher: Publisher, settings: Settings, unique: str
) -> None:
    bad, good = f"classic-{unique}", f"fine-{unique}"
    connection = await aio_pika.connect(settings.amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(broker.queue_name(bad), durable=True)  # classic queue
    try:
        jobs = make_jobs(bad, 3) + make_jobs(good, 4)
        result = await publisher.publish(jobs, epoch=1)
        assert {j.queue for j in result.confirmed} == {good}
        assert len(result.confirmed) == 4
        assert {(f.reason, f.job.queue) for f in result.failed} == {("declare", bad)}
        assert "different arguments" in result.failed[0].detail
        # the channel the failed declare closed has been reopened
        later = await publisher.publish(make_jobs(good, 2), epoch=1)
        assert len(later.confirmed) == 2
    finally:
        connection = await aio_pika.connect(settings.amqp_url, timeout=10)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(broker.queue_name(bad))


class CuttingPublisher(Publisher):
    """Cuts the proxied connection once ``cut_after`` confirms have come back."""

    def __init__(self, *args: object, proxy: FaultProxy, cut_after: int, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.proxy = proxy
        self.cut_after = cut_after
        self.confirms = 0

    async def _publish_one(
        self, channel: Any, job: ClaimedJob, epoch: int, deadline: float, staged: bool = False
    ) -> None:
        await super()._publish_one(channel, job, epoch, deadline, staged)
        self.confirms += 1
        if self.confirms == self.cut_after:
            self.proxy.cut()


async def test_connection_cut_mid_batch_reports_unconfirmed_jobs(
    settings: Settings, unique: str
) -> None:
    queue = f"cut-{unique}"
    target = urlsplit(settings.amqp_url)
    async with FaultProxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        pub = CuttingPublisher(
            proxy.route(settings.amqp_url),
            delivery_limit=settings.delivery_limit,
            publish_timeout=5,
            reconnect_interval=0.2,
            proxy=proxy,
            cut_after=100,
        )
        await pub.open()
        try:
            jobs = make_jobs(queue, 3000)
            result = await pub.publish(jobs, epoch=1)
            assert 100 <= len(result.confirmed) < 3000
            assert len(result.confirmed) + len(result.failed) == 3000
            assert {f.reason for f in result.failed} <= {"connection", "timeout"}
            print(
                f"\ncut: {len(result.confirmed)} confirmed, {len(result.failed)} failed "
                f"{sorted({f.reason for f in result.failed})} in {result.seconds:.2f}s"
            )

            pub.cut_after = 0  # no more cuts
            assert await pub.wait_ready(10)
            retry = await pub.publish([f.job for f in result.failed], epoch=1)
            assert retry.failed == []
        finally:
            await pub.close()
    # every job arrived at least once (a cut publish may have arrived anyway: at-least-once)
    got = await drain(settings.amqp_url, queue, expect=3000)
    assert {messages.decode(m.body).job_id for m in got} == {j.id for j in jobs}


async def test_slow_confirms_throttle_and_recover(settings: Settings, unique: str) -> None:
    queue = f"slow-{unique}"
    target = urlsplit(settings.amqp_url)
    async with FaultProxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        pub = Publisher(
            proxy.route(settings.amqp_url),
            delivery_limit=settings.delivery_limit,
            publish_timeout=0.5,
        )
        await pub.open()
        try:
            await pub.ensure_queue(queue)
            assert not should_throttle(pub)
            proxy.set_latency(0.4)  # a confirm needs > 0.8 s: the batch times out
            slow = await pub.publish(make_jobs(queue, 20), epoch=1)
            assert {f.reason for f in slow.failed} == {"timeout"}
            assert should_throttle(pub)
            assert 0 < pub.throttle_delay() <= 2.0
            proxy.heal()
            await asyncio.sleep(0.5)  # let the delayed frames of the slow batch land
            for _ in range(5):
                fast = await pub.publish(make_jobs(queue, 20), epoch=1)
                assert fast.failed == []
            assert pub.pressure < 0.1
            # the last pause bought by a slow batch runs out; fast batches buy none
            await wait_for(lambda: not should_throttle(pub), timeout=3, message="unthrottled")
        finally:
            await pub.close()


async def test_blocked_connection_is_seen(publisher: Publisher) -> None:
    """RabbitMQ's connection.blocked cannot be triggered here without starving the whole
    broker, so flip the aiormq event it drives: this fails loudly if aiormq renames it."""
    transport = publisher._connection.transport  # type: ignore[union-attr]
    event = transport.connection._Connection__connection_unblocked  # type: ignore[union-attr]
    assert isinstance(event, asyncio.Event) and event.is_set()
    assert not publisher.blocked
    event.clear()
    try:
        assert publisher.blocked
        assert should_throttle(publisher)
    finally:
        event.set()
    assert not should_throttle(publisher)


async def test_confirm_latency_for_one_message(publisher: Publisher, unique: str) -> None:
    """The idle fire lag includes one confirmed publish: keep it in milliseconds."""
    queue = f"one-{unique}"
    await publisher.ensure_queue(queue)
    samples = []
    for _ in range(50):
        started = time.perf_counter()
        result = await publisher.publish(make_jobs(queue, 1), epoch=1)
        samples.append(time.perf_counter() - started)
        assert len(result.confirmed) == 1
    samples.sort()
    p50, worst = samples[25] * 1000, samples[-1] * 1000
    print(f"\nsingle publish+confirm: p50 {p50:.2f} ms, max {worst:.2f} ms")
    assert samples[25] < 0.05
