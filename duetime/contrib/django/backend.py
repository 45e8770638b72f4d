"""``DuetimeBackend``: Django's ``BaseTaskBackend`` on duetime's jobs table.

Enqueue is ``duetime.enqueue`` on the Django connection (``OPTIONS["DATABASE"]``,
default ``"default"``), so it joins the transaction that connection is in; reading a
result is one ``SELECT`` through the same connection (``sync_jobs.get``). The mapping
of every field is in the package docstring.
"""

from __future__ import annotations

import difflib
from typing import Any

from django.conf import settings
from django.core.checks import Error
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.tasks import TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils import timezone

from duetime.contrib.django.names import NotAnAppTask, resolve, task_name
from duetime.contrib.django.results import task_result
from scheduler.errors import InvalidInput
from scheduler.jobspec import MAX_ATTEMPTS_LIMIT, validate_queue
from scheduler.store import sync_jobs

__all__ = ["DEFAULT_TASK_MODULES", "DuetimeBackend"]

#: The modules of each installed app a worker imports to find tasks.
DEFAULT_TASK_MODULES = ("tasks",)
OPTIONS = ("DATABASE", "MAX_ATTEMPTS", "TASK_MODULES")


class DuetimeBackend(BaseTaskBackend):
    """``TASKS = {"default": {"BACKEND": "duetime.contrib.django.DuetimeBackend",
    "QUEUES": [...], "OPTIONS": {...}}}``.

    ``OPTIONS``: ``DATABASE`` (the Django database alias jobs are written to and read
    from; default ``"default"``; it must be PostgreSQL with duetime's schema),
    ``MAX_ATTEMPTS`` (the jobs' attempt budget; default duetime's, 5),
    ``TASK_MODULES`` (which module of each installed app the worker imports to find
    tasks; default ``["tasks"]``).
    """

    supports_defer = True
    supports_async_task = False
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            hints = [
                f"{key!r}"
                + "".join(
                    f" (did you mean {m!r}?)" for m in difflib.get_close_matches(key, OPTIONS, 1)
                )
                for key in unknown
            ]
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']: unknown option {', '.join(hints)}; "
                f"known: {', '.join(OPTIONS)}"
            )
        self.database: str = self.options.get("DATABASE", "default")
        self.max_attempts: int | None = self.options.get("MAX_ATTEMPTS")
        if self.max_attempts is not None and (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or not 1 <= self.max_attempts <= MAX_ATTEMPTS_LIMIT
        ):
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']['MAX_ATTEMPTS'] must be an integer from 1 to "
                f"{MAX_ATTEMPTS_LIMIT}, not {self.max_attempts!r}"
            )
        self.task_modules: tuple[str, ...] = tuple(
            self.options.get("TASK_MODULES", DEFAULT_TASK_MODULES)
        )

    def validate_task(self, task: Any) -> None:
        super().validate_task(task)
        try:
            validate_queue(task.queue_name)
        except InvalidInput as exc:
            raise InvalidTask(f"queue_name: {exc}") from None

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        """Insert the job in the current transaction of ``OPTIONS["DATABASE"]``."""
        self.validate_task(task)
        name = task_name(task)
        pending = TaskResult(  # normalises args and kwargs to JSON, or raises TypeError
            task=task,
            id="",
            status=TaskResultStatus.READY,
            enqueued_at=None,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=list(args),
            kwargs=dict(kwargs),
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        options: dict[str, Any] = {"queue": task.queue_name, "priority": task.priority}
        if task.run_after is not None:
            due = task.run_after
            options["due_at"] = due if timezone.is_aware(due) else timezone.make_aware(due)
        if self.max_attempts is not None:
            options["max_attempts"] = self.max_attempts
        try:
            job = sync_jobs.enqueue(
                connections[self.database],
                name,
                {"args": pending.args, "kwargs": pending.kwargs},
                **options,
            )
        except InvalidInput as exc:
            raise InvalidTask(str(exc)) from None
        result = task_result(task, job, self.alias)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: Any) -> Any:
        """The job's row as a ``TaskResult``; ``TaskResultDoesNotExist`` for an id that is
        no job, or a job that is not a task of an installed app."""
        try:
            job_id = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        job = sync_jobs.get(connections[self.database], job_id)
        if job is None:
            raise TaskResultDoesNotExist(result_id)
        try:
            task = resolve(job.task)
        except NotAnAppTask as exc:
            raise TaskResultDoesNotExist(f"job {job_id}: {exc}") from None
        if task.queue_name != job.queue or task.priority != job.priority:
            try:  # the task as it was enqueued, when this backend accepts its queue
                task = task.using(queue_name=job.queue, priority=job.priority)
            except InvalidTask:
                pass
        return task_result(task, job, self.alias)

    def check(self, **kwargs: Any) -> list[Any]:
        """``manage.py check``: the database must exist and be PostgreSQL."""
        if self.database not in settings.DATABASES:
            return [
                Error(
                    f"TASKS[{self.alias!r}]: database {self.database!r} is not in DATABASES",
                    id="duetime.E001",
                )
            ]
        engine = settings.DATABASES[self.database].get("ENGINE", "")
        if "postgresql" not in engine:
            return [
                Error(
                    f"TASKS[{self.alias!r}]: database {self.database!r} is {engine}; "
                    "duetime needs PostgreSQL",
                    id="duetime.E002",
                )
            ]
        return []
