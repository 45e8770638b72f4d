"""A backend for Django's Tasks framework (``django.tasks``, Django >= 6.0).

::

    TASKS = {"default": {"BACKEND": "duetime.contrib.django.DuetimeBackend"}}

``my_task.enqueue(...)`` inserts a duetime job through the Django connection
(``scheduler.store.sync_jobs``), so inside ``transaction.atomic()`` the job commits or
rolls back with the view's own writes, and the dispatcher's wake-up is sent at COMMIT.
``result.refresh()``, ``status``, ``return_value`` and ``errors`` are read back from the
job's row (its status, its stored ``result`` and ``last_error``, migration 0019).
``duetime worker --django mysite.settings`` runs the project's tasks.

The mapping (``backend``, ``results``):

- task name: the Django task's module path (``shop.tasks.send_receipt``), which must lie
  inside an installed app; enqueueing any other is refused (``InvalidTask``).
- payload: ``{"args": [...], "kwargs": {...}}``, JSON as Django normalises it.
- ``queue_name`` → ``queue``; ``run_after`` → ``due_at``; ``priority`` → ``priority``
  unchanged: Django's range is -100..100, higher first, and so is the ``priority``
  column (CHECK ``jobs_priority_range``).
- status: pending → READY, dispatched → RUNNING, succeeded → SUCCESSFUL, dead and
  cancelled → FAILED (Django has no cancelled state; ``errors`` names
  ``scheduler.errors.JobCancelled``).

**Only tasks of installed apps run.** A message names a task, never code: the worker
registers, at start, the ``Task`` objects defined in the modules of installed apps (it
imports ``<app>.tasks`` for each app, or the ``TASK_MODULES`` of ``OPTIONS``) under
their module paths, and a job naming anything else fails as an unknown task. Reading a
result resolves the job's task name the same way (``names.resolve``).

Limits, said plainly: the task runs on a handler thread (a plain ``def`` handler,
``workers.threads``); its ORM writes go through Django's own connection, not the
attempt's ``ctx.db`` transaction, so they are at least once, not exactly once (a
worker killed after the task's writes and before the settlement runs it again).
``errors`` holds the last error only, its ``traceback`` is the recorded message (the
traceback goes to the worker's log); ``worker_ids`` has one entry per attempt started
(duetime does not record which worker ran an attempt); ``started_at`` is the start of
the last attempt. Async task functions are refused (``supports_async_task`` is False).
"""

from __future__ import annotations

import django

if django.VERSION < (6, 0):  # django.tasks arrived in 6.0, which needs Python >= 3.12
    raise ImportError(
        f"duetime.contrib.django needs Django >= 6.0 (django.tasks); this is Django "
        f"{django.get_version()}. duetime.enqueue works with Django >= 5.2."
    )

from duetime.contrib.django.backend import DuetimeBackend

__all__ = ["DuetimeBackend"]
