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


def test_a_rate_whose_window_is_full_holds_too() -> None:
    per_second = Limit("task:r", None, rate_count=5, rate_period=1)
    both = Limit("task:b", 3, rate_count=100, rate_period=60)
    per_key = Limit("task:k", None, per_key=True, rate_count=2, rate_period=3600)
    rows = [
        LimitRow(per_second, created_at=T, updated_at=T, running=5, due=7, started=5),
        LimitRow(per_second, created_at=T, updated_at=T, running=0, due=7, started=4),
        LimitRow(both, created_at=T, updated_at=T, running=3, due=1, started=100),
        LimitRow(per_key, created_at=T, updated_at=T, running=0, due=4, started=2),
    ]
    assert [f.message for f in limits_holding(rows)] == [
        "limit task:r holds 7 due jobs: 5 of 5/s started",
        "limit task:b holds 1 due jobs: 3 of 3 running, 100 of 100/min started",
        "limit task:k: its busiest key started 2 of 2/h; 4 due jobs of the target wait",
    ]
