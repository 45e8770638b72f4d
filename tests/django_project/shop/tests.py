"""``duetime.enqueue`` from Django, run by Django's own test runner against PostgreSQL:
the job commits or rolls back with the view's writes in ``transaction.atomic()``; the
view's job runs end to end with ``duetime.testing.drain``; under an OpenTelemetry span
the job stores the span's context."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import psycopg
from django.db import connection, transaction
from django.test import TransactionTestCase

import duetime
from duetime.testing import drain
from scheduler.migrate import migrate
from workers import Registry, SyncJobContext

from .models import Order


def _url() -> str:
    s = connection.settings_dict
    return f"postgresql://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


def _jobs(task: str) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT payload->>'order_id', status FROM duetime.jobs WHERE task = %s ORDER BY id",
            [task],
        )
        return cursor.fetchall()


class EnqueueInAtomic(TransactionTestCase):
    available_apps: ClassVar[list[str]] = ["tests.django_project.shop"]

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        asyncio.run(migrate(_url()))  # duetime's schema in Django's test database

    def setUp(self) -> None:
        with connection.cursor() as cursor:  # Django flushes only its own apps' tables
            cursor.execute("DELETE FROM duetime.jobs")

    def test_the_job_commits_with_the_views_write(self) -> None:
        with transaction.atomic():
            order = Order.objects.create(email="a@example.com")
            job = duetime.enqueue(task="send_receipt", payload={"order_id": order.id})
            # another session sees neither the order nor the job before COMMIT
            with psycopg.connect(_url(), autocommit=True) as other:
                seen = other.execute("SELECT count(*) FROM duetime.jobs").fetchone()
                self.assertEqual(seen, (0,))
        self.assertEqual(job.status, "pending")
        self.assertEqual(job.payload, {"order_id": order.id})
        self.assertEqual(_jobs("send_receipt"), [(str(order.id), "pending")])

    def test_a_rolled_back_view_leaves_no_job(self) -> None:
        with self.assertRaises(RuntimeError), transaction.atomic():
            Order.objects.create(email="b@example.com")
            duetime.enqueue(connection, "send_receipt", {"order_id": 99})
            raise RuntimeError("the view failed")
        self.assertEqual(Order.objects.count(), 0)
        self.assertEqual(_jobs("send_receipt"), [])

    def test_same_validation_and_bulk(self) -> None:
        with self.assertRaisesMessage(duetime.InvalidInput, "queue"):
            duetime.enqueue(task="t", payload={}, queue="no spaces allowed")
        with transaction.atomic():
            n = duetime.bulk_enqueue(
                connection, [duetime.JobSpec("bulk", {"order_id": i}) for i in range(3)]
            )
        self.assertEqual(n, 3)
        self.assertEqual(len(_jobs("bulk")), 3)

    def test_the_views_job_sends_the_receipt_when_drained(self) -> None:
        """Item 7's story with Django: the view enqueues in its atomic block, ``drain``
        runs the handler through the worker's code path, its ``ctx.db`` write lands."""
        registry = Registry()

        @registry.task("send_receipt")
        def send_receipt(ctx: SyncJobContext, payload: dict[str, Any]) -> None:
            ctx.db.execute(
                "UPDATE shop_order SET email = email || ' (receipt sent)' WHERE id = $1",
                payload["order_id"],
            )

        with transaction.atomic():  # the view
            order = Order.objects.create(email="c@example.com")
            duetime.enqueue(task="send_receipt", payload={"order_id": order.id})
        report = drain(_url(), registry=registry)
        self.assertEqual((report.runs, report["succeeded"]), (1, 1))
        order.refresh_from_db()
        self.assertEqual(order.email, "c@example.com (receipt sent)")
        self.assertEqual(_jobs("send_receipt"), [(str(order.id), "succeeded")])

    def test_the_job_stores_the_enqueuing_span(self) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        tracer = TracerProvider().get_tracer("shop")
        with tracer.start_as_current_span("checkout") as span, transaction.atomic():
            order = Order.objects.create(email="d@example.com")
            duetime.enqueue(task="traced", payload={"order_id": order.id})
        c = span.get_span_context()
        with connection.cursor() as cursor:
            cursor.execute("SELECT traceparent FROM duetime.jobs WHERE task = 'traced'")
            stored = cursor.fetchall()
        self.assertEqual(
            stored, [(f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}",)]
        )
        self.assertIsNot(trace.get_current_span(), span)
