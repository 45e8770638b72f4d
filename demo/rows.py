"""What one reading of the demo's run returns (``DemoStore.progress``): counts of its
jobs, the effects its handlers wrote, and their lag."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler.store.rows import FenceView


@dataclass(frozen=True, slots=True)
class JobCounts:
    total: int = 0
    pending: int = 0
    dispatched: int = 0
    succeeded: int = 0
    dead: int = 0
    cancelled: int = 0
    fired: int = 0

    @property
    def finished(self) -> int:
        return self.succeeded + self.dead + self.cancelled


@dataclass(frozen=True, slots=True)
class Lag:
    """Seconds from due_at to handler start."""

    p50: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def from_record(cls, record: Any) -> Lag:
        return cls(p50=record["p50"], p99=record.get("p99"), max=record["max"])


@dataclass(frozen=True, slots=True)
class JobEffects:
    effects: int = 0
    distinct_jobs: int = 0
    lag: Lag = Lag()

    @property
    def duplicates(self) -> int:
        return self.effects - self.distinct_jobs

    @classmethod
    def from_record(cls, record: Any) -> JobEffects:
        if record is None:
            return cls()
        return cls(record["effects"], record["distinct_jobs"], Lag.from_record(record))


@dataclass(frozen=True, slots=True)
class CronEffects:
    schedule: str
    effects: int
    distinct_fires: int
    lag: Lag

    @property
    def duplicates(self) -> int:
        return self.effects - self.distinct_fires


@dataclass(frozen=True, slots=True)
class Progress:
    """One consistent reading of the demo's run (one REPEATABLE READ transaction)."""

    fence: FenceView
    jobs: JobCounts
    effects: JobEffects
    by_worker: dict[str, int]
    cron: tuple[CronEffects, ...]
