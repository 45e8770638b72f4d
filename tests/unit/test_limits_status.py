"""`duetime status` lines for concurrency limits (scheduler.status.limits_holding)."""

from __future__ import annotations

from datetime import UTC, datetime

from scheduler.status import limits_holding
from scheduler.store.limits import Limit, LimitRow

T = datetime(2026, 1, 1, tzinfo=UTC)


def row(limit: Limit, running: int, due: int) -> LimitRow:
    return LimitRow(limit, created_at=T, updated_at=T, running=running, due=due)


def test_a_line_only_for_a_full_limit_with_due_jobs() -> None:
    rows = [
        row(Limit("task:a", 2), running=2, due=8),  # full, jobs wait: a line
        row(Limit("task:b", 2), running=1, due=8),  # room left: they start now
        row(Limit("task:c", 2), running=2, due=0),  # full, nothing waits
        row(Limit("queue:q", None, fair=True), running=9, due=9),  # fair only: no cap
        row(Limit("task:k", 1, per_key=True), running=1, due=3),
    ]
    found = limits_holding(rows)
    assert [f.code for f in found] == ["limit_holding", "limit_holding"]
    assert found[0].message == "limit task:a holds 8 due jobs: 2 of 2 running"
    assert (
        found[1].message
        == "limit task:k: its busiest key runs 1 of 1; 3 due jobs of the target wait"
    )
