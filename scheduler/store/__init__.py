"""Typed stores: the only code that runs SQL (statements live in ``scheduler/sql``)."""

from scheduler.store.execution import ExecutionStore, LockedJob
from scheduler.store.jobs import JobStore

__all__ = ["ExecutionStore", "JobStore", "LockedJob"]
