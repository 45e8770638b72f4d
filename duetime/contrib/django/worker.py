"""``duetime worker --django SETTINGS``: the project's tasks as duetime handlers.

``load_tasks`` sets up Django, imports each installed app's task modules
(``TASK_MODULES``, default ``tasks``), and registers every ``Task`` defined in a module
of an installed app whose backend is a ``DuetimeBackend``, under its module path, as a
plain ``def`` handler (it runs on a handler thread, ``workers.threads``). Nothing else
is registered, so a message naming anything else fails as an unknown task.

The handler calls the task with the job's ``args`` and ``kwargs``; its return value
(normalised to JSON as Django does) is the job's ``result``. An exception the task
raises is recorded under its full class path (``TaskRaised``), so ``TaskError``
names the class the task raised. Django's database connections are closed around each
call when unusable or past ``CONN_MAX_AGE``, as Django does around a request.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from scheduler.errors import InvalidInput
from workers.registry import Registry

__all__ = ["TaskRaised", "load_tasks"]


class TaskRaised(Exception):
    """What a Django task raised, recorded under the raised class's full path: the
    worker writes ``"<type name>: <message>"`` to ``last_error``, and each subclass
    (one per raised class, made by ``_recorded``) is named by that path."""


_RECORDED: dict[str, type[TaskRaised]] = {}


def _recorded(exc: Exception) -> TaskRaised:
    kind = type(exc)
    path = f"{kind.__module__}.{kind.__qualname__}"
    cls = _RECORDED.get(path)
    if cls is None:
        cls = _RECORDED.setdefault(path, type(path, (TaskRaised,), {"__module__": __name__}))
    return cls(str(exc))


def _passes_through(exc: Exception) -> bool:
    """duetime's own exceptions (``Retry``, ``Fail``, ``Snooze``, ``AttemptAbandoned``)
    keep their meaning for the worker."""
    return type(exc).__module__.split(".")[0] in ("workers", "scheduler")


def handler_for(task: Any) -> Any:
    """The plain ``def (ctx, payload)`` handler that runs ``task``."""
    from django.db import close_old_connections
    from django.tasks import TaskContext, TaskResult, TaskResultStatus
    from django.utils import timezone
    from django.utils.json import normalize_json

    from workers.retry import Fail

    def run(ctx: Any, payload: dict[str, Any]) -> Any:
        args, kwargs = payload.get("args", []), payload.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise Fail(f"{task.module_path}: payload must be {{'args': [...], 'kwargs': {{...}}}}")
        close_old_connections()
        try:
            if task.takes_context:
                now = timezone.now()
                running = TaskResult(
                    task=task,
                    id=str(ctx.job_id),
                    status=TaskResultStatus.RUNNING,
                    enqueued_at=None,
                    started_at=now,
                    finished_at=None,
                    last_attempted_at=now,
                    args=args,
                    kwargs=kwargs,
                    backend=task.backend,
                    errors=[],
                    worker_ids=["duetime"] * ctx.attempt,
                )
                value = task.call(TaskContext(task_result=running), *args, **kwargs)
            else:
                value = task.call(*args, **kwargs)
        except Exception as exc:
            if _passes_through(exc):
                raise
            raise _recorded(exc) from exc
        finally:
            close_old_connections()
        return normalize_json(value)

    run.__qualname__ = f"django task {task.module_path}"
    return run


def setup(settings_module: str) -> None:
    """``django.setup()`` with ``settings_module``, the current directory importable (as
    with ``manage.py``)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    try:
        import django
    except ImportError:
        raise InvalidInput(
            "--django needs Django installed (pip install 'duetime[django]')"
        ) from None
    try:
        django.setup()
    except Exception as exc:
        raise InvalidInput(f"--django {settings_module}: {type(exc).__name__}: {exc}") from exc


def load_tasks(settings_module: str, registry: Registry) -> list[str]:
    """Set Django up, register the installed apps' duetime-backed tasks in ``registry``;
    returns their names. ``InvalidInput`` when Django cannot start or no task is found."""
    setup(settings_module)
    from django.apps import apps
    from django.conf import settings
    from django.tasks import Task, task_backends
    from django.utils.module_loading import autodiscover_modules

    from duetime.contrib.django.backend import DuetimeBackend

    aliases = {
        alias
        for alias in getattr(settings, "TASKS", {})
        if isinstance(task_backends[alias], DuetimeBackend)
    }
    if not aliases:
        raise InvalidInput(
            f"--django {settings_module}: no TASKS backend is duetime.contrib.django.DuetimeBackend"
        )
    modules = sorted({m for a in aliases for m in task_backends[a].task_modules})
    try:
        autodiscover_modules(*modules)
    except Exception as exc:
        raise InvalidInput(
            f"--django {settings_module}: importing the apps' {', '.join(modules)} modules "
            f"failed: {type(exc).__name__}: {exc}"
        ) from exc
    names: list[str] = []
    for module_name, module in sorted(sys.modules.copy().items()):
        if module is None or apps.get_containing_app_config(module_name) is None:
            continue
        for value in list(vars(module).values()):
            if (
                isinstance(value, Task)
                and value.func.__module__ == module_name
                and value.backend in aliases
            ):
                registry.register(value.module_path, handler_for(value))
                names.append(value.module_path)
    if not names:
        raise InvalidInput(
            f"--django {settings_module}: no task of an installed app uses "
            f"DuetimeBackend (looked in each app's {', '.join(modules)} module)"
        )
    return sorted(names)
