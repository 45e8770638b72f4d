"""What the duties that claim jobs report alike: job ids in a log line, and parked rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scheduler.metrics import JOBS_PARKED
from scheduler.store.rows import ParkedRow

__all__ = ["MAX_IDS_LOGGED", "report_parked", "some_ids"]

#: At most this many job ids are written into one log line (the count is always there).
MAX_IDS_LOGGED = 100


def some_ids(ids: Sequence[int]) -> dict[str, object]:
    """The ``count`` and ``job_ids`` fields of a log line about many jobs (the first
    ``MAX_IDS_LOGGED`` ids)."""
    return {"count": len(ids), "job_ids": list(ids[:MAX_IDS_LOGGED])}


def report_parked(parked: Sequence[ParkedRow], *, shard: str, log: Any) -> int:
    """Count and log each row ``DispatchStore.park_unreadable`` handled, one line per
    row (an unreadable row is rare, and each is worth a look); returns how many went
    dead."""
    for row in parked:
        JOBS_PARKED.labels(shard, "unreadable").inc(row.parked)
        log.error(
            "job_unreadable",
            job_id=row.job_id,
            error=row.reason,
            outcome="dead" if row.parked else "left as it is",
        )
    return sum(row.parked for row in parked)
