"""A duetime job row as Django's ``TaskResult`` (``DuetimeBackend.get_result``).

Pure: takes the ``Task`` and the ``Job`` read by the backend, does no I/O.
"""

from __future__ import annotations

import builtins
import re
from typing import Any

from django.tasks import TaskResult, TaskResultStatus
from django.tasks.base import TaskError

from scheduler.store.rows import Job

__all__ = ["STATUS", "error_class_path", "task_result"]

#: duetime's job status → Django's. Django has no cancelled state: a cancelled job
#: FAILED, with ``scheduler.errors.JobCancelled`` as its error.
STATUS: dict[str, str] = {
    "pending": TaskResultStatus.READY,
    "dispatched": TaskResultStatus.RUNNING,
    "succeeded": TaskResultStatus.SUCCESSFUL,
    "dead": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}

_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
#: The error of a failure that names no exception class (e.g. an attempt timed out).
FAILED_PATH = "scheduler.errors.JobFailed"
CANCELLED_PATH = "scheduler.errors.JobCancelled"


def error_class_path(last_error: str) -> str:
    """The exception class path a ``last_error`` starts with. The worker records
    ``"Type: message"``; a Django task's exception is recorded under its full path
    (``worker.TaskRaised``), a builtin one's bare name becomes ``builtins.Name``, and
    anything else is ``scheduler.errors.JobFailed``."""
    head = last_error.split(": ", 1)[0].strip()
    if not _PATH.fullmatch(head):
        return FAILED_PATH
    if "." in head:
        return head
    found = getattr(builtins, head, None)
    if isinstance(found, type) and issubclass(found, BaseException):
        return f"builtins.{head}"
    return FAILED_PATH


def attempts_started(job: Job) -> int:
    """How many attempts have started: ``attempt`` is the number of the current (or
    next) attempt, so a job waiting for one has started one fewer."""
    if job.status in ("dispatched", "succeeded", "dead"):
        return job.attempt
    if job.status == "cancelled" and job.dispatched_at is not None:
        return job.attempt
    return max(job.attempt - 1, 0)


def _errors(job: Job) -> list[Any]:
    if job.status == "cancelled":
        by = f" by {job.cancelled_by}" if job.cancelled_by else ""
        return [TaskError(exception_class_path=CANCELLED_PATH, traceback=f"cancelled{by}")]
    if job.last_error:
        return [
            TaskError(
                exception_class_path=error_class_path(job.last_error), traceback=job.last_error
            )
        ]
    return []


def task_result(task: Any, job: Job, backend: str) -> Any:
    """The ``TaskResult`` of ``job`` (run by ``task``); its return value is the stored
    ``result`` once SUCCESSFUL."""
    payload = job.payload if isinstance(job.payload, dict) else {}
    result = TaskResult(
        task=task,
        id=str(job.id),
        status=STATUS[job.status],
        enqueued_at=job.created_at,
        started_at=job.dispatched_at,
        finished_at=job.finished_at,
        last_attempted_at=job.dispatched_at,
        args=list(payload.get("args", [])),
        kwargs=dict(payload.get("kwargs", {})),
        backend=backend,
        errors=_errors(job),
        worker_ids=["duetime"] * attempts_started(job),
    )
    if job.status == "succeeded":
        object.__setattr__(result, "_return_value", job.result)
    return result
