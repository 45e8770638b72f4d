"""Typed stores: the only code that runs SQL (statements live in ``scheduler/sql``).

``conn`` holds what every store shares (the ``Conn`` type, a pool with its acquire
timeout); ``rows`` every row type a store returns. One store per area: ``jobs``
(producers), ``dispatch`` (dispatcher, reconciler), ``execution`` (workers),
``schedules`` (users, planner), ``queues`` (declared queues), ``maintenance``,
``fence``, ``status``, ``dashboard`` and ``listener`` (the LISTEN
connections that wake the duties).
"""

from scheduler.store.dashboard import DashboardStore
from scheduler.store.dispatch import DispatchStore
from scheduler.store.execution import ExecutionStore
from scheduler.store.fence import FenceStore
from scheduler.store.jobs import JobFilter, JobStore
from scheduler.store.listener import ChannelListener, KeptListener
from scheduler.store.maintenance import MaintenanceStore
from scheduler.store.queues import QueueStore
from scheduler.store.rows import BulkPreview, Job, LockedJob, StalledJob
from scheduler.store.schedules import ScheduleStore
from scheduler.store.status import StatusStore

__all__ = [
    "BulkPreview",
    "ChannelListener",
    "DashboardStore",
    "DispatchStore",
    "ExecutionStore",
    "FenceStore",
    "Job",
    "JobFilter",
    "JobStore",
    "KeptListener",
    "LockedJob",
    "MaintenanceStore",
    "QueueStore",
    "ScheduleStore",
    "StalledJob",
    "StatusStore",
]
