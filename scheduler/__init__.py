"""duetime's scheduler package, and the producer API at its root.

Producers (web apps, scripts, other services) enqueue jobs and manage schedules with::

    from duetime import JobStore, ScheduleSpec, ScheduleStore, create_pool, load_settings

``duetime`` re-exports the names below (the same objects), and ``docs/api.md`` shows
each in use; they are the whole producer API. The rest of the package (config, stores,
election, the leader's duties, the CLI) is the scheduler service itself, importable but
not promised to stay where it is.

The names are loaded on first use (PEP 562 ``__getattr__``): ``import scheduler.cron``
or ``import scheduler.config`` is what every worker, CLI command and duty starts with,
and must not pay for asyncpg and the stores, nor run into a module that is still being
imported (``scheduler.store`` imports ``scheduler.config``, which is a submodule of
this package). Type checkers see the real imports below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # settings and connections
    "Settings": "scheduler.config",
    "load_settings": "scheduler.config",
    "connect": "scheduler.db",
    "create_pool": "scheduler.db",
    "pool_from_settings": "scheduler.db",
    # jobs
    "JobStore": "scheduler.store.jobs",
    "JobFilter": "scheduler.store.jobs",
    "BulkPreview": "scheduler.store.jobs",
    "JobSpec": "scheduler.jobspec",
    "Job": "scheduler.store.rows",
    # enqueue in the caller's transaction from psycopg, SQLAlchemy, Django (and asyncpg)
    "enqueue": "scheduler.store.sync_jobs",
    "bulk_enqueue": "scheduler.store.sync_jobs",
    "enqueue_async": "scheduler.store.sync_jobs",
    # workflows (chain, group, chord: duetime.workflow)
    "Workflow": "scheduler.workflow",
    "enqueue_workflow": "scheduler.store.sync_jobs",
    # producers on several shards (one shard, "main", when none are configured)
    "ShardRouter": "scheduler.shards.router",
    "RoutedJob": "scheduler.shards.router",
    # schedules
    "ScheduleStore": "scheduler.store.schedules",
    "ScheduleSpec": "scheduler.planning",
    "Schedule": "scheduler.planning",
    "ScheduleNotFound": "scheduler.planning",
    "ScheduleDeclaration": "scheduler.planning.declared",
    "DeclaredSchedule": "scheduler.planning.declared",
    "ScheduleConflict": "scheduler.store.schedules",
    # errors (the tree is drawn in scheduler/errors.py)
    "DuetimeError": "scheduler.errors",
    "ConfigError": "scheduler.errors",
    "InvalidInput": "scheduler.errors",
    "JobNotFound": "scheduler.errors",
    "JobFailed": "scheduler.errors",
    "JobCancelled": "scheduler.errors",
    "InvalidTransition": "scheduler.errors",
    "ServiceUnavailable": "scheduler.errors",
    "UniqueKeyTaken": "scheduler.errors",
}

__all__ = [
    "BulkPreview",
    "ConfigError",
    "DeclaredSchedule",
    "DuetimeError",
    "InvalidInput",
    "InvalidTransition",
    "Job",
    "JobCancelled",
    "JobFailed",
    "JobFilter",
    "JobNotFound",
    "JobSpec",
    "JobStore",
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
    "UniqueKeyTaken",
    "Workflow",
    "bulk_enqueue",
    "connect",
    "create_pool",
    "enqueue",
    "enqueue_async",
    "enqueue_workflow",
    "load_settings",
    "pool_from_settings",
]

if TYPE_CHECKING:
    from scheduler.config import Settings, load_settings
    from scheduler.db import connect, create_pool, pool_from_settings
    from scheduler.errors import (
        ConfigError,
        DuetimeError,
        InvalidInput,
        InvalidTransition,
        JobCancelled,
        JobFailed,
        JobNotFound,
        ServiceUnavailable,
        UniqueKeyTaken,
    )
    from scheduler.jobspec import JobSpec
    from scheduler.planning import Schedule, ScheduleNotFound, ScheduleSpec
    from scheduler.planning.declared import DeclaredSchedule, ScheduleDeclaration
    from scheduler.shards.router import RoutedJob, ShardRouter
    from scheduler.store.jobs import BulkPreview, JobFilter, JobStore
    from scheduler.store.rows import Job
    from scheduler.store.schedules import ScheduleConflict, ScheduleStore
    from scheduler.store.sync_jobs import bulk_enqueue, enqueue, enqueue_async, enqueue_workflow
    from scheduler.workflow import Workflow


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'scheduler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
