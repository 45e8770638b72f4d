"""Typed stores: the only code that runs SQL (statements live in ``scheduler/sql``)."""

from scheduler.store.dispatch import DispatchStore, JobsListener, StalledJob
from scheduler.store.execution import ExecutionStore, LockedJob
from scheduler.store.jobs import JobStore
from scheduler.store.schedules import SchedulesListener, ScheduleStore

__all__ = [
    "DispatchStore",
    "ExecutionStore",
    "JobStore",
    "JobsListener",
    "LockedJob",
    "ScheduleStore",
    "SchedulesListener",
    "StalledJob",
]
