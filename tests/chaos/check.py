"""The verdict of a chaos run, read from PostgreSQL only (DESIGN §1).

Recorded while the run goes on, by the database itself or by the handler:

- ``chaos_effects`` / ``chaos_deliveries`` (``tests/chaos/chaos_tasks.py``): one effect
  row per *committed* handler run (no unique constraint), one delivery row per handler
  run (separate autocommit connection, so rolled-back and killed runs are counted);
- ``chaos_claims``: a *deferred* constraint trigger on ``duetime.jobs`` fires at COMMIT
  of every transaction that set ``dispatch_epoch``/``dispatched_at`` (a dispatcher claim
  or a reconciler re-publish) and records the job, its ``dispatch_epoch`` and the
  ``leader_fence`` epoch *as committed at that instant*. A claim whose epoch differs
  from the fence at its commit is a stale (zombie) claim that got through.

Checked after the run (``verify``): every job reached ``succeeded`` (none lost, none
dead); exactly one effect row per job, and none for a job that is not ours; no stale
claim. Reported, not judged: duplicate deliveries, handler runs rolled back, fire lag.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import asyncpg

from tests.chaos.chaos_tasks import CHECK_SCHEMA_SQL, TASK

CLAIMS_SQL = """
CREATE TABLE IF NOT EXISTS public.chaos_claims (
    id             bigserial   PRIMARY KEY,
    at             timestamptz NOT NULL DEFAULT clock_timestamp(),
    app            text        NOT NULL DEFAULT current_setting('application_name'),
    txid           bigint      NOT NULL DEFAULT txid_current(),
    job_id         bigint      NOT NULL,
    attempt        integer     NOT NULL,
    status         text        NOT NULL,
    dispatch_epoch bigint,
    fence_epoch    bigint
);
CREATE OR REPLACE FUNCTION public.chaos_claim_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- runs at COMMIT (deferred): a fresh READ COMMITTED snapshot sees the fence as it is
    -- now, not as it was when the claim statement ran
    INSERT INTO public.chaos_claims (job_id, attempt, status, dispatch_epoch, fence_epoch)
    VALUES (NEW.id, NEW.attempt, NEW.status, NEW.dispatch_epoch,
            (SELECT epoch FROM duetime.leader_fence WHERE shard = 0));
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS chaos_claim_audit ON duetime.jobs;
CREATE CONSTRAINT TRIGGER chaos_claim_audit AFTER UPDATE ON duetime.jobs
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.dispatch_epoch IS NOT NULL
          AND (NEW.dispatch_epoch IS DISTINCT FROM OLD.dispatch_epoch
               OR NEW.dispatched_at IS DISTINCT FROM OLD.dispatched_at))
    EXECUTE FUNCTION public.chaos_claim_audit();
"""

SETUP_SQL = CHECK_SCHEMA_SQL + CLAIMS_SQL
TERMINAL = ("succeeded", "dead", "cancelled")
SHOW = 20  # job ids listed per problem


@dataclass
class Report:
    """What one scenario run did and whether the guarantees held."""

    scenario: str
    seed: int
    soak: bool
    jobs: int = 0
    succeeded: int = 0
    lost: int = 0  # not terminal at the end of the run
    not_succeeded: int = 0  # terminal but dead/cancelled (the handler never fails for good)
    double_effects: int = 0  # jobs with more than one committed effect
    missing_effects: int = 0  # succeeded jobs without an effect
    stray_effects: int = 0  # effect rows of jobs that are not ours
    handler_runs: int = 0
    duplicate_deliveries: int = 0  # extra handler runs of the same (job, attempt)
    rolled_back_runs: int = 0  # handler runs whose transaction never committed
    planned_failures: int = 0  # attempts that raised on purpose (fail_attempts)
    skipped_deliveries: int = 0  # deliveries the ledger/row check settled without a run
    claims: int = 0  # committed claims and re-publishes
    stale_claims: int = 0  # committed under an epoch other than the fence's
    epochs: int = 0  # distinct epochs that committed claims
    failovers: list[float] = field(default_factory=list)
    max_failover_s: float | None = None
    max_fire_lag_s: float | None = None
    p50_fire_lag_s: float | None = None
    p99_fire_lag_s: float | None = None
    faults: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    late_s: float = 0.0  # seconds past the settle time the run was given (a slow machine)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}s"

        return (
            f"[chaos] {self.scenario} seed={self.seed}: jobs {self.jobs}, lost {self.lost}, "
            f"not succeeded {self.not_succeeded}, double effects {self.double_effects}, "
            f"duplicate deliveries {self.duplicate_deliveries} (+{self.skipped_deliveries} "
            f"skipped by ledger/row check), rolled-back runs {self.rolled_back_runs} "
            f"(planned {self.planned_failures}), stale claims {self.stale_claims}/"
            f"{self.claims} over {self.epochs} epochs, failovers {len(self.failovers)} "
            f"max {s(self.max_failover_s)}, fire lag p50 {s(self.p50_fire_lag_s)} "
            f"p99 {s(self.p99_fire_lag_s)} max {s(self.max_fire_lag_s)}, "
            f"{len(self.faults)} faults, {self.duration_s:.1f}s"
            + (f" (settled {self.late_s:.1f}s past its settle time)" if self.late_s else "")
        )

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["ok"] = self.ok
        return json.dumps(data, default=str, separators=(",", ":"))


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


async def verify(
    conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy, report: Report
) -> Report:
    """Fill ``report`` from the database; every broken invariant becomes a problem
    naming the job ids (and their rows) involved. Give it a connection in a repeatable
    read transaction: its counts must come from one snapshot."""
    jobs = await conn.fetch(
        "SELECT id, status, attempt, dispatch_epoch, dispatched_at, last_error "
        "FROM duetime.jobs WHERE task = $1 ORDER BY id",
        TASK,
    )
    ids = {r["id"] for r in jobs}
    report.jobs = len(jobs)
    report.succeeded = sum(r["status"] == "succeeded" for r in jobs)
    lost = [r for r in jobs if r["status"] not in TERMINAL]
    bad_end = [r for r in jobs if r["status"] in TERMINAL and r["status"] != "succeeded"]
    report.lost, report.not_succeeded = len(lost), len(bad_end)
    for name, rows in (("lost (not terminal)", lost), ("not succeeded", bad_end)):
        if rows:
            report.problems.append(f"{len(rows)} job(s) {name}: {_rows(rows)}")

    effects = {
        r["job_id"]: r["n"]
        for r in await conn.fetch(
            "SELECT job_id, count(*) AS n FROM public.chaos_effects GROUP BY job_id"
        )
    }
    doubled = sorted(j for j, n in effects.items() if n > 1 and j in ids)
    missing = sorted(r["id"] for r in jobs if r["status"] == "succeeded" and r["id"] not in effects)
    stray = sorted(j for j in effects if j not in ids)
    report.double_effects, report.missing_effects = len(doubled), len(missing)
    report.stray_effects = len(stray)
    if doubled:
        detail = await conn.fetch(
            "SELECT job_id, attempt, node, pid, at FROM public.chaos_effects "
            "WHERE job_id = ANY($1::bigint[]) ORDER BY job_id, at",
            doubled[:SHOW],
        )
        report.problems.append(f"{len(doubled)} job(s) with doubled effects: {_rows(detail)}")
    if missing:
        report.problems.append(f"{len(missing)} succeeded job(s) without effect: {missing[:SHOW]}")
    if stray:
        report.problems.append(f"effects for unknown job ids: {stray[:SHOW]}")

    runs = await conn.fetch(
        "SELECT job_id, attempt, count(*) AS n FROM public.chaos_deliveries GROUP BY 1, 2"
    )
    report.handler_runs = sum(r["n"] for r in runs)
    report.duplicate_deliveries = sum(r["n"] - 1 for r in runs)
    report.rolled_back_runs = report.handler_runs - sum(effects.values())
    report.planned_failures = await conn.fetchval(
        "SELECT count(DISTINCT (d.job_id, d.attempt)) FROM public.chaos_deliveries d "
        "JOIN duetime.jobs j ON j.id = d.job_id "
        "WHERE d.attempt <= coalesce((j.payload->>'fail_attempts')::int, 0)"
    )
    ledger = await conn.fetchval("SELECT count(*) FROM duetime.job_ledger WHERE task = $1", TASK)
    if ledger != report.succeeded:
        report.problems.append(f"{ledger} ledger rows for {report.succeeded} succeeded jobs")

    claims = await conn.fetchrow(
        "SELECT count(*) AS n, count(DISTINCT dispatch_epoch) AS epochs, "
        "count(*) FILTER (WHERE dispatch_epoch IS DISTINCT FROM fence_epoch) AS stale "
        "FROM public.chaos_claims"
    )
    assert claims is not None
    report.claims, report.epochs = claims["n"], claims["epochs"]
    report.stale_claims = claims["stale"]
    if report.stale_claims:
        stale = await conn.fetch(
            "SELECT job_id, attempt, dispatch_epoch, fence_epoch, app, txid, at "
            "FROM public.chaos_claims WHERE dispatch_epoch IS DISTINCT FROM fence_epoch "
            "ORDER BY id LIMIT $1",
            SHOW,
        )
        report.problems.append(f"{report.stale_claims} stale claim(s) committed: {_rows(stale)}")

    lags = [
        float(r["lag"])
        for r in await conn.fetch(
            "SELECT extract(epoch FROM min(d.at) - j.due_at)::float8 AS lag "
            "FROM public.chaos_deliveries d JOIN duetime.jobs j ON j.id = d.job_id "
            "WHERE d.attempt = 1 AND j.task = $1 GROUP BY d.job_id, j.due_at",
            TASK,
        )
    ]
    report.max_fire_lag_s = max(lags) if lags else None
    report.p50_fire_lag_s = _quantile(lags, 0.50)
    report.p99_fire_lag_s = _quantile(lags, 0.99)
    report.max_failover_s = max(report.failovers) if report.failovers else None
    return report


def _rows(rows: list[asyncpg.Record]) -> str:
    shown = [dict(r) for r in rows[:SHOW]]
    more = f" … and {len(rows) - SHOW} more" if len(rows) > SHOW else ""
    return f"{shown}{more}"


async def lag_timeline(conn: asyncpg.Connection | asyncpg.Pool, bucket: float = 1.0) -> str:
    """Per ``bucket`` seconds of due time (from the first job): jobs due, and the median
    and max delay until their first handler run — where a fault left its mark."""
    rows = await conn.fetch(
        "WITH first AS (SELECT job_id, min(at) AS at FROM public.chaos_deliveries "
        "               WHERE attempt = 1 GROUP BY job_id), "
        "j AS (SELECT j.id, j.due_at, f.at FROM duetime.jobs j "
        "      LEFT JOIN first f ON f.job_id = j.id WHERE j.task = $1), "
        "t0 AS (SELECT min(due_at) AS t0 FROM j) "
        "SELECT floor(extract(epoch FROM j.due_at - t0.t0) / $2)::int AS b, count(*) AS n, "
        "       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM j.at - j.due_at)) "
        "           AS p50, max(extract(epoch FROM j.at - j.due_at))::float8 AS max "
        "FROM j, t0 GROUP BY 1 ORDER BY 1",
        TASK,
        bucket,
    )
    return "\n".join(
        f"  due +{r['b'] * bucket:5.1f}s: {r['n']:6d} jobs, fire lag p50 "
        f"{(r['p50'] or 0):7.3f}s max {(r['max'] or 0):7.3f}s"
        for r in rows
    )
