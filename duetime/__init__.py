"""duetime's public Python API in one namespace: ``pip install duetime``, ``import duetime``.

Producers::

    from duetime import JobStore, ScheduleSpec, ScheduleStore, create_pool, load_settings
    from duetime import ShardRouter  # one store per shard, jobs routed by key
    from duetime import enqueue  # from psycopg / SQLAlchemy / Django, in their transaction
    from duetime.workflow import chain, chord, group, step  # workflows (Celery's canvas)

Handlers and workers::

    from duetime import Fail, JobContext, Retry, Worker, task

Handler tests::

    from duetime.testing import run_task

Every name here is the very object ``scheduler`` (producer side) or ``workers`` (worker
side) exports; ``docs/api.md`` documents them with examples that the test suite runs.

Why a third package: the distribution is called ``duetime``, so ``import duetime`` is
what a user tries first, and it is the one top-level name that is ours alone on PyPI.
The code stays in ``scheduler/`` and ``workers/`` (the layout the design fixes, and
``from workers import task`` is a documented contract). What this does not fix: those
two names (and ``demo``, installed for ``duetime demo``) are generic, and another
distribution installing a top-level package of the same name would overwrite ours in
the same environment (and this package with it).
Only moving the code under ``duetime/`` would remove that; ``docs/api.md`` says when.
This package holds no code of its own (``duetime.contrib``, integrations with other
frameworks such as Django's Tasks, is the exception: it adapts them to these names and
is imported only by those who import it), so it cannot drift from the two roots:
``tests/unit/test_public_api.py`` checks that its names are exactly theirs.

Nothing is imported until a name is used (PEP 562), so ``import duetime`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: ``scheduler``'s names (producer side) and ``workers``' names (worker side)
__all__ = [
    "AttemptAbandoned",
    "BulkPreview",
    "ConfigError",
    "DeclaredSchedule",
    "Dependency",
    "DuetimeError",
    "DuplicateTask",
    "Fail",
    "InvalidInput",
    "InvalidTransition",
    "Job",
    "JobCancelled",
    "JobContext",
    "JobFailed",
    "JobFilter",
    "JobNotFound",
    "JobSpec",
    "JobStore",
    "Registry",
    "Retry",
    "RetryPolicy",
    "RoutedJob",
    "Schedule",
    "ScheduleConflict",
    "ScheduleDeclaration",
    "ScheduleNotFound",
    "ScheduleSpec",
    "ScheduleStore",
    "ServiceUnavailable",
    "Settings",
    "ShardRouter",
    "Snooze",
    "SyncJobContext",
    "TaskSpec",
    "UniqueKeyTaken",
    "Worker",
    "WorkerStartupFailed",
    "WorkerState",
    "Workflow",
    "bulk_enqueue",
    "connect",
    "create_pool",
    "default_registry",
    "enqueue",
    "enqueue_async",
    "enqueue_workflow",
    "load_settings",
    "pool_from_settings",
    "run_worker",
    "task",
    "worker_shutdown",
    "worker_startup",
]

if TYPE_CHECKING:
    from scheduler import (
        BulkPreview,
        ConfigError,
        DeclaredSchedule,
        DuetimeError,
        InvalidInput,
        InvalidTransition,
        Job,
        JobCancelled,
        JobFailed,
        JobFilter,
        JobNotFound,
        JobSpec,
        JobStore,
        RoutedJob,
        Schedule,
        ScheduleConflict,
        ScheduleDeclaration,
        ScheduleNotFound,
        ScheduleSpec,
        ScheduleStore,
        ServiceUnavailable,
        Settings,
        ShardRouter,
        UniqueKeyTaken,
        Workflow,
        bulk_enqueue,
        connect,
        create_pool,
        enqueue,
        enqueue_async,
        enqueue_workflow,
        load_settings,
        pool_from_settings,
    )
    from workers import (
        AttemptAbandoned,
        Dependency,
        DuplicateTask,
        Fail,
        JobContext,
        Registry,
        Retry,
        RetryPolicy,
        Snooze,
        SyncJobContext,
        TaskSpec,
        Worker,
        WorkerStartupFailed,
        WorkerState,
        default_registry,
        run_worker,
        task,
        worker_shutdown,
        worker_startup,
    )


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'duetime' has no attribute {name!r}")
    import scheduler  # cheap: its names load on first use

    home = "scheduler" if name in scheduler.__all__ else "workers"
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
