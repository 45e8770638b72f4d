"""Typed stores: the only code that runs SQL (statements live in ``scheduler/sql``)."""

from scheduler.store.dispatch import DispatchStore, StalledJob
from scheduler.store.execution import ExecutionStore, LockedJob
from scheduler.store.jobs import JobStore
from scheduler.store.listener import ChannelListener, KeptListener
from scheduler.store.schedules import ScheduleStore

__all__ = [
    "ChannelListener",
    "DispatchStore",
    "ExecutionStore",
    "JobStore",
    "KeptListener",
    "LockedJob",
    "ScheduleStore",
    "StalledJob",
]
