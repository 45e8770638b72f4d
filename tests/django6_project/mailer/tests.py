"""The Django Tasks backend (duetime.contrib.django) under Django's own test runner, on
Django 6 and PostgreSQL: enqueue joins ``transaction.atomic()``, the Task's options land
in duetime's columns, results are read from the job's row, and only tasks of installed
apps are enqueued or registered. tests/integration/test_django_tasks.py runs this and,
separately, a real worker end to end."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import psycopg
from django.db import connection, transaction
from django.tasks import TaskResultStatus, default_task_backend
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.test import TransactionTestCase

import duetime
from duetime.contrib.django.results import error_class_path
from duetime.contrib.django.worker import load_tasks
from scheduler.migrate import migrate
from tests.django6_project import outside
from workers.registry import Registry

from . import tasks
from .models import Receipt


def _url() -> str:
    s = connection.settings_dict
    return f"postgresql://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


def _row(job_id: str) -> tuple[Any, ...]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT task, payload::text, queue, priority, due_at, max_attempts, status "
            "FROM duetime.jobs WHERE id = %s",
            [int(job_id)],
        )
        row = cursor.fetchone()
    assert row is not None, job_id
    return tuple(row)


class DuetimeBackendTests(TransactionTestCase):
    available_apps: ClassVar[list[str]] = ["tests.django6_project.mailer"]

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        asyncio.run(migrate(_url()))  # duetime's schema in Django's test database

    def setUp(self) -> None:
        with connection.cursor() as cursor:  # Django flushes only its own apps' tables
            cursor.execute("DELETE FROM duetime.jobs")

    def test_enqueue_commits_with_the_views_write(self) -> None:
        with transaction.atomic():
            Receipt.objects.create(email="a@example.com")
            result = tasks.add.enqueue(2, b=3)
            with psycopg.connect(_url(), autocommit=True) as other:
                seen = other.execute("SELECT count(*) FROM duetime.jobs").fetchone()
                self.assertEqual(seen, (0,))  # not before COMMIT
        self.assertEqual(result.status, TaskResultStatus.READY)
        self.assertEqual((result.args, result.kwargs), ([2], {"b": 3}))
        task, payload, queue, priority, _due, attempts, status = _row(result.id)
        self.assertEqual(task, "tests.django6_project.mailer.tasks.add")
        self.assertEqual(payload, '{"args": [2], "kwargs": {"b": 3}}')
        self.assertEqual((queue, priority, attempts, status), ("default", 0, 1, "pending"))

    def test_a_rolled_back_view_leaves_no_job(self) -> None:
        with self.assertRaises(RuntimeError), transaction.atomic():
            Receipt.objects.create(email="b@example.com")
            tasks.add.enqueue(1, 1)
            raise RuntimeError("the view failed")
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM duetime.jobs")
            self.assertEqual(cursor.fetchone(), (0,))
        self.assertFalse(Receipt.objects.exists())

    def test_priority_queue_name_and_run_after_map_onto_the_columns(self) -> None:
        later = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
        for priority in (-100, 100):
            result = tasks.add.using(priority=priority, queue_name="mail", run_after=later).enqueue(
                1, 2
            )
            _, _, queue, stored, due, _, _ = _row(result.id)
            self.assertEqual((queue, stored, due), ("mail", priority, later))
        with self.assertRaisesMessage(InvalidTask, "between -100 and 100"):
            tasks.add.using(priority=101)
        with self.assertRaisesMessage(InvalidTask, "queue_name"):
            tasks.add.using(queue_name="no spaces allowed")

    def test_a_task_outside_the_installed_apps_is_refused(self) -> None:
        with self.assertRaisesMessage(InvalidTask, "in no installed app"):
            outside.stray.enqueue()
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM duetime.jobs")
            self.assertEqual(cursor.fetchone(), (0,))

    def test_results_are_read_from_the_jobs_row(self) -> None:
        result = tasks.add.enqueue(2, 3)
        fetched = default_task_backend.get_result(result.id)
        self.assertEqual((fetched.status, fetched.attempts), (TaskResultStatus.READY, 0))
        with self.assertRaisesMessage(ValueError, "not finished"):
            _ = fetched.return_value
        self.assertEqual(tasks.add.get_result(result.id).id, result.id)
        with self.assertRaises(TaskResultDoesNotExist):
            default_task_backend.get_result("999999")
        with self.assertRaises(TaskResultDoesNotExist):
            default_task_backend.get_result("not a number")
        plain = duetime.enqueue(connection, "os.system", {"args": ["true"], "kwargs": {}})
        with self.assertRaisesMessage(TaskResultDoesNotExist, "not a task of an installed app"):
            default_task_backend.get_result(str(plain.id))
        with connection.cursor() as cursor:  # a cancelled job is FAILED, its error says so
            cursor.execute(
                "UPDATE duetime.jobs SET status = 'cancelled', cancelled_by = 'ops', "
                "finished_at = now() WHERE id = %s",
                [int(result.id)],
            )
        result.refresh()
        self.assertEqual(result.status, TaskResultStatus.FAILED)
        self.assertEqual(result.errors[0].exception_class_path, "scheduler.errors.JobCancelled")

    def test_error_class_paths_from_last_error(self) -> None:
        self.assertEqual(error_class_path("ValueError: bad"), "builtins.ValueError")
        self.assertEqual(error_class_path("a.b.Boom: x: y"), "a.b.Boom")
        self.assertEqual(error_class_path("timed out after 5s"), "scheduler.errors.JobFailed")
        self.assertEqual(error_class_path("Nope: x"), "scheduler.errors.JobFailed")

    def test_the_worker_registers_only_the_installed_apps_tasks(self) -> None:
        registry = Registry()
        names = load_tasks("tests.django6_project.settings", registry)
        app = "tests.django6_project.mailer.tasks"
        self.assertEqual(names, [f"{app}.{n}" for n in ("add", "attempt", "fail", "send_receipt")])
        self.assertNotIn("tests.django6_project.outside.stray", registry)  # imported above
        spec = registry.get(f"{app}.add")
        assert spec is not None
        self.assertTrue(spec.sync)  # a plain def handler, on the worker's threads
        self.assertEqual(spec.handler(None, {"args": [2], "kwargs": {"b": 5}}), {"sum": 7})
        failing = registry.get(f"{app}.fail")
        assert failing is not None
        with self.assertRaises(Exception) as raised:
            failing.handler(None, {"args": ["boom"], "kwargs": {}})
        self.assertEqual(type(raised.exception).__name__, f"{app}.MailerError")
        self.assertIsInstance(raised.exception.__cause__, tasks.MailerError)

    def test_run_after_in_the_past_is_due_now(self) -> None:
        past = datetime.now(UTC) - timedelta(hours=1)
        result = tasks.add.using(run_after=past).enqueue(0, 0)
        self.assertEqual(_row(result.id)[4], past)
