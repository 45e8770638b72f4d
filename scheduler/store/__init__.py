"""Typed stores: the only code that runs SQL (statements live in ``scheduler/sql``)."""

from scheduler.store.dashboard import DashboardStore
from scheduler.store.dispatch import DispatchStore, StalledJob
from scheduler.store.execution import ExecutionStore, LockedJob
from scheduler.store.jobs import BulkPreview, JobFilter, JobStore
from scheduler.store.listener import ChannelListener, KeptListener
from scheduler.store.schedules import ScheduleStore

__all__ = [
    "BulkPreview",
    "ChannelListener",
    "DashboardStore",
    "DispatchStore",
    "ExecutionStore",
    "JobFilter",
    "JobStore",
    "KeptListener",
    "LockedJob",
    "ScheduleStore",
    "StalledJob",
]
