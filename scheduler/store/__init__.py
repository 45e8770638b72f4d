"""Typed stores: the only code that runs SQL (statements live in ``scheduler/sql``)."""

from scheduler.store.jobs import JobStore

__all__ = ["JobStore"]
