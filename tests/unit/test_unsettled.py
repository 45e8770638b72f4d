"""The dispatcher's memory of jobs published by a claim that did not commit
(scheduler/duties/unsettled.py): pure, on a ManualClock."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from scheduler.clock import ManualClock
from scheduler.duties.unsettled import Unsettled
from scheduler.store.rows import ClaimedJob

DUE = datetime(2026, 1, 1, tzinfo=UTC)


def job(i: int, attempt: int = 1) -> ClaimedJob:
    return ClaimedJob(id=i, task="t", queue="q", due_at=DUE, attempt=attempt)


def test_remembered_attempts_are_published_after_the_commit_others_inside() -> None:
    memory = Unsettled(clock=ManualClock(), ttl=10)
    memory.remember([job(1), job(2)])
    fresh, later = memory.split([job(1), job(2, attempt=2), job(3)])
    assert [j.id for j in later] == [1]
    assert [(j.id, j.attempt) for j in fresh] == [(2, 2), (3, 1)]
    memory.forget(later)
    assert memory.split([job(1)]) == ([job(1)], [])


def test_entries_expire_after_ttl_and_the_oldest_go_over_capacity() -> None:
    clock = ManualClock()
    memory = Unsettled(clock=clock, ttl=10, capacity=3)
    memory.remember([job(1)])
    clock.advance(5)
    memory.remember([job(2), job(3), job(4)])  # job 1 dropped: over capacity
    assert len(memory) == 3
    assert memory.split([job(1), job(2)])[1] == [job(2)]
    clock.advance(10)
    assert memory.split([job(2), job(3)]) == ([job(2), job(3)], [])
    assert len(memory) == 0


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="ttl"):
        Unsettled(clock=ManualClock(), ttl=0)
