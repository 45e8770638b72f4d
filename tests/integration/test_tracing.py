"""OpenTelemetry (scheduler/tracing.py, migration 0023) with the SDK's in-memory exporter,
against real PostgreSQL and RabbitMQ: every producer API stores the enqueuing span's
context, a worker's attempt is its child (or, for a job due later, a new trace linked to
it), the dispatcher's publish is a span, and without OpenTelemetry nothing is stored."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once
from sqlalchemy import create_engine

import duetime
from duetime.testing import drain_async
from scheduler import db
from scheduler.config import Settings
from scheduler.jobspec import JobSpec
from scheduler.publisher import Publisher
from scheduler.store.jobs import JobStore
from scheduler.store.rows import ClaimedJob
from tests.fixtures_tasks.jobs import FENCE_EPOCH
from tests.support.helpers import running_worker
from tests.support.wait import wait_for
from workers import JobContext, Registry

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The SDK, as an application configures it; the global provider is unset after."""
    provider = TracerProvider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    try:
        yield memory
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
        trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    exporter.clear()
    yield exporter
    exporter.clear()


def _traceparent(span: Any) -> str:
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def _named(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


async def _stored(pool: asyncpg.Pool, task: str) -> list[str | None]:
    rows = await pool.fetch(
        "SELECT traceparent FROM duetime.jobs WHERE task = $1 ORDER BY id", task
    )
    return [r["traceparent"] for r in rows]


@pytest.fixture
async def fresh_pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(migrated_dsn, min_size=1, max_size=3)
    try:
        yield pool
    finally:
        await pool.close()


async def test_the_async_producer_apis_store_the_enqueuing_span(
    db_pool: asyncpg.Pool, spans: InMemorySpanExporter, unique: str
) -> None:
    task = f"t.async-{unique}"
    store = JobStore(db_pool)
    with trace.get_tracer("test").start_as_current_span("checkout") as span:
        await store.enqueue(task, {})
        await store.enqueue(task, {}, unique_key="one")
        await store.enqueue(task, {}, unique_key="one")  # skipped: the holder is unchanged
        await store.bulk_enqueue([JobSpec(task), JobSpec(task)])
        async with db_pool.acquire() as conn:
            await duetime.enqueue_async(conn, task, {})
    assert await _stored(db_pool, task) == [_traceparent(span)] * 5
    await store.enqueue(task, {})  # no span active: nothing
    assert (await _stored(db_pool, task))[-1] is None


def test_the_sync_producer_apis_store_the_enqueuing_span(
    dsn: str, spans: InMemorySpanExporter, unique: str
) -> None:
    task = f"t.sync-{unique}"
    engine = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with trace.get_tracer("test").start_as_current_span("view") as span:
            with psycopg.connect(dsn) as conn:
                duetime.enqueue(conn, task, {})
                duetime.bulk_enqueue(conn, [JobSpec(task)])
            with engine.begin() as connection:
                duetime.enqueue(connection, task, {"via": "sqlalchemy"})
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT traceparent FROM duetime.jobs WHERE task = %s", (task,)
            ).fetchall()
    finally:
        engine.dispose()
    assert rows == [(_traceparent(span),)] * 3


async def _dispatch(pool: asyncpg.Pool, job_id: int) -> tuple[ClaimedJob, int]:
    """Claim the job by hand, as the dispatcher would (the fence's epoch)."""
    row = await pool.fetchrow(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        f"run_at = NULL, dispatch_epoch = {FENCE_EPOCH} WHERE id = $1 "
        "RETURNING id, task, queue, due_at, run_at, attempt, dispatch_epoch",
        job_id,
    )
    assert row is not None
    return ClaimedJob.from_record(row), int(row["dispatch_epoch"])


async def test_attempts_are_children_of_the_enqueuing_span_and_publishes_are_spans(
    settings: Settings, db_pool: asyncpg.Pool, queue: str, spans: InMemorySpanExporter
) -> None:
    """Through the broker and a real worker: the first attempt fails, the retry
    succeeds; both are children of the span that enqueued, the handler runs inside the
    attempt's span, and each dispatch's publish is a PRODUCER span."""
    registry = Registry()
    inside: list[Any] = []

    @registry.task("t.traced")
    async def traced(ctx: JobContext, payload: dict[str, Any]) -> None:
        inside.append(trace.get_current_span().get_span_context())
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    with trace.get_tracer("test").start_as_current_span("checkout") as parent:
        job = await JobStore(db_pool).enqueue("t.traced", {}, queue=queue)
    publisher = Publisher(settings.amqp_url, delivery_limit=settings.delivery_limit)
    await publisher.open()
    try:
        async with running_worker(settings, registry, queue):
            for attempt, status in ((1, "pending"), (2, "succeeded")):
                claimed, epoch = await _dispatch(db_pool, job.id)
                assert claimed.attempt == attempt
                assert (await publisher.publish([claimed], epoch)).confirmed == [claimed]
                await wait_for(
                    lambda s=status: _status_is(db_pool, job.id, s),
                    timeout=15,  # type: ignore[misc]
                )
            await wait_for(lambda: len(_named(spans, "process ")) == 2, timeout=5)
    finally:
        await publisher.close()

    destination = f"duetime.{queue}"
    attempts = sorted(_named(spans, "process "), key=lambda s: s.attributes["duetime.job.attempt"])
    expected = parent.get_span_context()
    for number, span in enumerate(attempts, start=1):
        assert span.kind is SpanKind.CONSUMER and span.name == f"process {destination}"
        assert span.parent is not None and span.parent.span_id == expected.span_id
        assert span.context.trace_id == expected.trace_id and not span.links
        assert dict(span.attributes) == {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": destination,
            "messaging.message.id": f"{job.id}:{number}",
            "duetime.job.id": job.id,
            "duetime.job.attempt": number,
            "duetime.task": "t.traced",
            "duetime.outcome": "retried" if number == 1 else "succeeded",
        } | ({"error.type": "RuntimeError"} if number == 1 else {})
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert [e.name for e in attempts[0].events] == ["exception"]
    assert attempts[1].status.status_code is StatusCode.UNSET
    assert [c.span_id for c in inside] == [s.context.span_id for s in attempts]

    publishes = _named(spans, "publish ")
    assert len(publishes) == 2
    for span in publishes:
        assert span.kind is SpanKind.PRODUCER and span.name == f"publish {destination}"
        assert dict(span.attributes) == {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": destination,
            "messaging.batch.message_count": 1,
        }


async def _status_is(pool: asyncpg.Pool, job_id: int, status: str) -> bool:
    return await pool.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job_id) == status


async def test_a_job_due_later_runs_in_a_new_trace_linked_to_its_enqueuer(
    fresh_pool: asyncpg.Pool, spans: InMemorySpanExporter
) -> None:
    """A plain-SQL producer sets the traceparent itself; the job was enqueued an hour
    before it was due, so its attempt starts a trace of its own with a link."""
    registry = Registry()

    @registry.task("t.later")
    async def later(ctx: JobContext, payload: dict[str, Any]) -> None:
        return None

    stored = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await fresh_pool.execute(
        "INSERT INTO duetime.jobs (task, traceparent, created_at, due_at) "
        "VALUES ('t.later', $1, now() - interval '2 hours', now() - interval '1 hour')",
        stored,
    )
    report = await drain_async(fresh_pool, registry=registry)
    assert report["succeeded"] == 1
    (span,) = _named(spans, "process ")
    assert span.parent is None
    assert span.context.trace_id != 0x0AF7651916CD43DD8448EB211C80319C
    (link,) = span.links
    assert (link.context.trace_id, link.context.span_id) == (
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
    )


async def test_without_opentelemetry_nothing_is_stored_and_nothing_is_traced(
    fresh_pool: asyncpg.Pool, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seam's 'absent' case: ``opentelemetry.trace`` not imported by the process.
    A span the application holds is then invisible to duetime, and the attempt runs
    without a span."""
    registry = Registry()

    @registry.task("t.plain")
    async def plain(ctx: JobContext, payload: dict[str, Any]) -> None:
        return None

    with trace.get_tracer("test").start_as_current_span("outside"):
        monkeypatch.delitem(sys.modules, "opentelemetry.trace")
        job = await JobStore(fresh_pool).enqueue("t.plain", {})
        report = await drain_async(fresh_pool, registry=registry)
        monkeypatch.undo()
    assert report["succeeded"] == 1
    assert await _stored(fresh_pool, "t.plain") == [None]
    assert [s.name for s in spans.get_finished_spans()] == ["outside"]
    assert job.status == "pending"
