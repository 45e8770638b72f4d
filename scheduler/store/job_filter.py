"""JobFilter: which jobs a list, a dashboard page or a bulk action is about, and the SQL
predicates (``jobs.sql`` ``job_filter``) every statement that filters jobs splices in.

A filter with tags is its own statement text (``filter_for``), read from the tag index
(migration 0022), and is planned for the tags given each time (``planned_for``): the
best plan depends on how common the tags are (docs/benchmarks.md "Tag filter").
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from scheduler.errors import InvalidInput
from scheduler.jobspec import validate_tag
from scheduler.sql import fragment, load
from scheduler.store.conn import Conn
from scheduler.store.rows import JOB_STATUSES

__all__ = ["FILTERS", "JobFilter", "filter_for", "planned_for"]

#: The JobFilter predicates ($1..$6), shared by every statement that filters jobs: one
#: text without tags and one with (``filter_for``), so each is planned on its own.
FILTERS = {
    tagged: fragment("jobs", "job_filter")
    + "\n"
    + fragment("jobs", "job_filter_tagged" if tagged else "job_filter_untagged")
    for tagged in (False, True)
}
_CUSTOM_PLANS = load("jobs")["custom_plans"]


@dataclass(frozen=True, slots=True)
class JobFilter:
    """Which jobs a bulk action (and the dashboard's job list) is about. Every field is
    optional; ``error`` matches a substring of ``last_error``, case-insensitively;
    ``tags`` matches the jobs holding every tag given (a list is kept as a tuple)."""

    status: str | None = None
    queue: str | None = None
    task: str | None = None
    due_from: datetime | None = None
    due_to: datetime | None = None
    error: str | None = None
    tags: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in JOB_STATUSES:
            raise InvalidInput(f"unknown status {self.status!r} (one of {', '.join(JOB_STATUSES)})")
        if self.due_from and self.due_to and self.due_from >= self.due_to:
            raise InvalidInput("the due window must start before it ends")
        object.__setattr__(self, "tags", _filter_tags(self.tags))

    def params(self) -> tuple[Any, ...]:
        """The filter as the statements' $1..$6 (status is matched separately)."""
        tags = list(self.tags) or None
        return (self.queue, self.task, self.due_from, self.due_to, self.error, tags)


def _filter_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """Tags to filter by, each by the rule a job's tags follow (a tag no job can hold
    is a mistake worth naming), without repeats."""
    if tags is None:
        return ()
    if isinstance(tags, str) or not isinstance(tags, list | tuple):
        raise InvalidInput(f"tags must be a list of strings, not {type(tags).__name__}")
    return tuple(dict.fromkeys(validate_tag(t) for t in tags))


def filter_for(where: JobFilter) -> str:
    """The predicates to splice as ``{filter}`` for ``where``: with or without tags."""
    return FILTERS[bool(where.tags)]


@contextlib.asynccontextmanager
async def planned_for(c: Conn, where: JobFilter) -> AsyncIterator[None]:
    """Run the statements of a tag filter planned for the tags given (jobs.sql
    ``custom_plans``), in a transaction (a savepoint in the caller's, whose rest then
    plans the same way); a filter without tags runs as it is."""
    if not where.tags:
        yield
        return
    async with c.transaction():
        await c.execute(_CUSTOM_PLANS)
        yield
