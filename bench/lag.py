"""Fire lag from the handler's start rows: per job, first start − due (what a user feels),
and dispatched_at − due (the scheduler's share; the rest is broker + worker)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.report import percentiles_ms


@dataclass
class LagSummary:
    jobs: int = 0
    duplicates: int = 0
    lag: dict[str, float | None] = field(default_factory=dict)
    dispatch_lag: dict[str, float | None] = field(default_factory=dict)
    first_due: float | None = None
    last_due: float | None = None
    first_start: float | None = None
    last_start: float | None = None
    points: list[tuple[float, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "jobs_started": self.jobs,
            "duplicates": self.duplicates,
            "lag": self.lag,
            "dispatch_lag": self.dispatch_lag,
        }


def summarize(rows: Sequence[Any], *, origin: float | None = None) -> LagSummary:
    """``rows`` as returned by ``Sandbox.starts()`` (job_id, runs, started, due, dispatched)."""
    if not rows:
        return LagSummary(lag=percentiles_ms([]), dispatch_lag=percentiles_ms([]))
    lags = [r["started"] - r["due"] for r in rows]
    dispatch = [r["dispatched"] - r["due"] for r in rows if r["dispatched"] is not None]
    first_due = min(r["due"] for r in rows)
    base = first_due if origin is None else origin
    return LagSummary(
        jobs=len(rows),
        duplicates=sum(r["runs"] - 1 for r in rows),
        lag=percentiles_ms(lags),
        dispatch_lag=percentiles_ms(dispatch),
        first_due=first_due,
        last_due=max(r["due"] for r in rows),
        first_start=min(r["started"] for r in rows),
        last_start=max(r["started"] for r in rows),
        points=[(r["due"] - base, (r["started"] - r["due"]) * 1000) for r in rows],
    )
