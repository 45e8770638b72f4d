"""Task names: a Django task's module path, inside an installed app, and back.

A job's ``task`` column is data; turning it into code is a lookup, never an import of
whatever it names. ``resolve`` accepts a name only when its module belongs to an
installed app (``apps.get_containing_app_config``) and the object there is a ``Task``
defined in that very module (not one imported from elsewhere under another name).
"""

from __future__ import annotations

import importlib
from typing import Any

from django.apps import apps
from django.tasks import Task
from django.tasks.exceptions import InvalidTask

__all__ = ["NotAnAppTask", "resolve", "task_name"]


class NotAnAppTask(InvalidTask):
    """A task outside the installed apps, or a name that is not such a task."""


def task_name(task: Any) -> str:
    """The duetime task name of ``task`` (its module path), refused with
    ``NotAnAppTask`` unless the function is defined in an installed app's module."""
    module = task.func.__module__
    if apps.get_containing_app_config(module) is None:
        raise NotAnAppTask(
            f"task {task.module_path} is defined in module {module!r}, which is in no "
            "installed app: duetime workers run only tasks defined in INSTALLED_APPS "
            "(move it into an app, e.g. <app>/tasks.py)"
        )
    return str(task.module_path)


def resolve(name: str) -> Any:
    """The ``Task`` a job's task name stands for; ``NotAnAppTask`` when it names none of
    an installed app's tasks (nothing outside the installed apps is imported)."""
    module_name, _, attribute = name.rpartition(".")
    if not module_name or apps.get_containing_app_config(module_name) is None:
        raise NotAnAppTask(f"{name!r} is not a task of an installed app")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise NotAnAppTask(f"{name!r}: module {module_name!r} does not import") from None
    found = getattr(module, attribute, None)
    if not isinstance(found, Task) or found.func.__module__ != module_name:
        raise NotAnAppTask(f"{name!r} is not a task defined in {module_name!r}")
    return found
