"""The verdict of a demo run: nothing lost, nothing applied twice, and how fast.

Judged from the effects table alone (what handlers committed through ``ctx.db``):

- **lost** = jobs published − distinct jobs with an effect (a job that went ``dead`` or
  never ran counts as lost: the demo's handlers never fail);
- **duplicates** = effect rows − distinct jobs (and likewise per cron fire time);
- **lag** = handler start − due_at, overall and outside the failover gap;
- **failover** = SIGKILL of the leader → new leader fenced → its first dispatch.

``ok`` (exit code 0) needs lost = 0 and no duplicates.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from demo.rows import Lag, Progress
from demo.view import fmt_lag, fmt_seconds


@dataclass(frozen=True, slots=True)
class Failover:
    killed: str
    killed_epoch: int
    new_leader: str | None = None
    new_epoch: int | None = None
    fenced_after: float | None = None  # seconds from SIGKILL to the new leader's fence
    first_dispatch_after: float | None = None  # ... to its first dispatch of a demo job


@dataclass(frozen=True, slots=True)
class CronResult:
    schedule: str
    fires: int
    duplicates: int
    lag_p50: float | None
    lag_max: float | None


@dataclass(slots=True)
class Summary:
    run_id: str
    database: str
    queue: str
    etcd_prefix: str
    log_dir: str
    published: int
    succeeded: int
    dead: int
    unfinished: int
    lost: int
    duplicates: int
    lag: Lag
    steady_lag: Lag | None
    drained_in: float | None  # seconds after the last job was due, None: did not drain
    failover: Failover | None
    cron: list[CronResult]
    cron_note: str | None
    by_worker: dict[str, int]
    children: dict[str, list[int]]
    needed_sigkill: list[str] = field(default_factory=list)

    @property
    def cron_duplicates(self) -> int:
        return sum(c.duplicates for c in self.cron)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicates == 0 and self.cron_duplicates == 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(ok=self.ok, cron_duplicates=self.cron_duplicates)
        return data

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")


def judge(
    *,
    progress: Progress,
    published: int,
    steady_lag: Lag | None,
    drained_in: float | None,
    failover: Failover | None,
    cron_note: str | None,
    **ids: Any,
) -> Summary:
    effects = progress.effects
    return Summary(
        published=published,
        succeeded=progress.jobs.succeeded,
        dead=progress.jobs.dead,
        unfinished=progress.jobs.total - progress.jobs.finished,
        lost=published - effects.distinct_jobs,
        duplicates=effects.duplicates,
        lag=effects.lag,
        steady_lag=steady_lag,
        drained_in=drained_in,
        failover=failover,
        cron=[
            CronResult(c.schedule, c.effects, c.duplicates, c.lag.p50, c.lag.max)
            for c in progress.cron
        ],
        cron_note=cron_note,
        by_worker=dict(progress.by_worker),
        **ids,
    )


def render(s: Summary, out: TextIO) -> None:
    def line(label: str, text: str) -> None:
        print(f"  {label:<11}{text}", file=out)

    print(f"\nduetime demo summary (run {s.run_id}, database {s.database})", file=out)
    line(
        "jobs",
        f"{s.published} published, {s.succeeded} succeeded, {s.dead} dead, "
        f"{s.unfinished} unfinished"
        + (
            f"; drained {fmt_seconds(s.drained_in)} after the last due time"
            if s.drained_in is not None
            else "; NOT drained within the grace period"
        ),
    )
    line("lost", f"{s.lost}  (published − distinct jobs with an effect)")
    line("duplicates", f"{s.duplicates}  (effects applied more than once)")
    line("lag", fmt_lag(s.lag) + "  (handler start − due_at)")
    if s.steady_lag is not None:
        line("", f"outside the failover gap: {fmt_lag(s.steady_lag)}")
    f = s.failover
    if f is None:
        line("failover", "not exercised")
    else:
        line(
            "failover",
            f"killed leader {f.killed} (epoch {f.killed_epoch}) with SIGKILL; "
            + (
                f"{f.new_leader} fenced epoch {f.new_epoch} after {fmt_seconds(f.fenced_after)}, "
                f"first dispatch after {fmt_seconds(f.first_dispatch_after)}"
                if f.new_epoch is not None
                else "NO new leader took over"
            ),
        )
    if s.cron:
        fires = ", ".join(
            f"{c.schedule} {c.fires} fires (lag p50 {fmt_seconds(c.lag_p50)})" for c in s.cron
        )
        line("cron", f"{fires}; {s.cron_duplicates} duplicates")
    elif s.cron_note:
        line("cron", s.cron_note)
    if s.by_worker:
        line("workers", ", ".join(f"{w} ran {n}" for w, n in sorted(s.by_worker.items())))
    stopped = "all children stopped" + (
        f" (SIGKILL needed for {', '.join(s.needed_sigkill)})" if s.needed_sigkill else ""
    )
    line("processes", stopped)
    line("logs", s.log_dir)
    verdict = (
        "OK: nothing lost, nothing applied twice"
        if s.ok
        else f"FAILED: {s.lost} lost, {s.duplicates + s.cron_duplicates} duplicates"
    )
    print(f"\nRESULT: {verdict}", file=out, flush=True)
