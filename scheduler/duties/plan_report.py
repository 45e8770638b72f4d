"""What one planner batch did: its ``PlanReport``, counted in metrics (labelled with
the planner's shard) and logged.

Apart from ``planner`` because it is pure bookkeeping over the batch's decisions (no
database, no clock): the planner calls ``account_batch`` once per committed batch and
sums the reports of a pass with ``PlanReport.add``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from scheduler.metrics import SCHEDULE_FIRES, SCHEDULE_MISFIRES
from scheduler.planning import PlanDecision
from scheduler.store.rows import ClaimedSchedule

__all__ = ["MAX_LOGGED", "PlanReport", "account_batch"]

#: At most this many schedules are named in one log line (the totals are always there).
MAX_LOGGED = 50


@dataclass(slots=True)
class PlanReport:
    """What one batch (or, summed, one pass) did."""

    claimed: int = 0
    fired: int = 0
    duplicates: int = 0  # fire times already materialized (dedupe hits)
    missed: int = 0
    skipped: int = 0
    invalid: int = 0
    revisit: bool = False  # some schedule must be looked at again at once
    batches: int = 0
    missed_by_policy: Counter[str] = field(default_factory=Counter)
    claim_seconds: float = 0.0  # BEGIN + fence + claim
    decide_seconds: float = 0.0  # pure planning
    write_seconds: float = 0.0  # apply_plan + COMMIT

    def add(self, other: PlanReport) -> None:
        self.claimed += other.claimed
        self.fired += other.fired
        self.duplicates += other.duplicates
        self.missed += other.missed
        self.skipped += other.skipped
        self.invalid += other.invalid
        self.revisit = other.revisit
        self.batches += other.batches
        self.missed_by_policy.update(other.missed_by_policy)
        self.claim_seconds += other.claim_seconds
        self.decide_seconds += other.decide_seconds
        self.write_seconds += other.write_seconds


def account_batch(
    claimed: Sequence[ClaimedSchedule],
    decisions: Sequence[PlanDecision],
    fired: dict[int, int],
    now: datetime,
    log: Any,
    *,
    shard: str,
) -> PlanReport:
    report = PlanReport(claimed=len(claimed), batches=1)
    missed_log: list[dict[str, object]] = []
    overlap_log: list[dict[str, object]] = []
    for item, d in zip(claimed, decisions, strict=True):
        s = item.schedule
        created = fired.get(d.schedule_id, 0)
        report.fired += created
        report.duplicates += len(d.fires) - created
        report.skipped += d.skipped
        if d.plan_at is not None and d.plan_at <= now:
            report.revisit = True
        if d.invalid:
            report.invalid += 1
            log.error(
                "schedule_invalid",
                schedule_id=s.id,
                schedule=s.name,
                error=d.error,
                outcome="paused",
            )
            continue
        if d.missed:
            report.missed += d.missed
            report.missed_by_policy[s.misfire_policy] += d.missed
            if len(missed_log) < MAX_LOGGED:
                missed_log.append(
                    {
                        "id": s.id,
                        "name": s.name,
                        "missed": d.missed,
                        "skipped": d.skipped_misfire,
                        "first": d.first_missed.isoformat() if d.first_missed else None,
                        "last": d.last_missed.isoformat() if d.last_missed else None,
                    }
                )
        if d.skipped_overlap and len(overlap_log) < MAX_LOGGED:
            overlap_log.append({"id": s.id, "name": s.name, "skipped": d.skipped_overlap})
    SCHEDULE_FIRES.labels(shard).inc(report.fired)
    for policy, count in report.missed_by_policy.items():
        SCHEDULE_MISFIRES.labels(shard, policy).inc(count)
    if report.missed:
        log.warning(
            "schedules_misfired",
            missed=report.missed,
            by_policy=dict(report.missed_by_policy),
            schedules=missed_log,
        )
    if overlap_log:
        log.info(
            "schedules_overlap_skipped",
            skipped=sum(d.skipped_overlap for d in decisions),
            schedules=overlap_log,
        )
    if report.duplicates:
        log.warning("schedule_fires_deduplicated", duplicates=report.duplicates)
    return report
