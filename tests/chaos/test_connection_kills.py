"""A storm of connection kills (``make chaos``): every duetime backend of the database is
terminated (``pg_terminate_backend``) every 0.5 s for 40 s, under a steady ~600 jobs/s.

Phases, on one clock (the database's): a baseline of ``BASELINE_S`` without kills, the
storm, then ``RECOVERY_S`` without kills. Reported: completions per second in each
phase, how soon after the storm a ``WINDOW_S`` window completes at least 90 % of the
baseline rate, dead jobs, the copies the dispatcher published by claims that did not
commit, and the deliveries workers skipped. Asserted: recovery within ``RECOVERY_S``,
zero dead jobs, and the guarantees of ``tests/chaos/check.py`` (no job lost, one effect
per job, no stale claim). The figures go to docs/benchmarks.md ("Connection-kill storm")
and, one JSON line per ``make chaos`` run, to tests/chaos/results.jsonl.

``CHAOS_KILL_RATE`` (default 600 jobs/s under ``make chaos``, the outside harness's rate;
100 in ``make test``) must be a rate the
machine sustains without kills, or there is no recovery to see: above it the backlog
grows and completions fall from the first second, kills or not (``CHAOS_KILL_STORM=0``
runs that control; docs/benchmarks.md has both on the shared 2-core VM, where 150/s is
sustainable). ``CHAOS_SETTLE_S``: how long the run waits for every job to finish.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import pytest

from tests.chaos.check import lag_timeline
from tests.chaos.harness import RESULTS, ChaosCluster, Plan

pytestmark = pytest.mark.chaos

#: ``make chaos`` (``DUETIME_TEST_SOAK=1``) runs the outside harness's storm: 600 jobs/s,
#: kills for 40 s. ``make test`` runs a CI-sized one (100 jobs/s, kills for 10 s), which
#: still shows both defects on the old code (parked jobs, stale copies, a stall after).
SOAK = os.environ.get("DUETIME_TEST_SOAK") == "1"
RATE = int(os.environ.get("CHAOS_KILL_RATE", "600" if SOAK else "100"))  # jobs due per second
BASELINE_S = 15.0 if SOAK else 8.0
STORM_S = 40.0 if SOAK else 10.0
KILL_EVERY_S = 0.5
#: ``CHAOS_KILL_STORM=0``: the same run without a kill (the control for the figures)
KILLING = os.environ.get("CHAOS_KILL_STORM", "1") != "0"
RECOVERY_S = 30.0
WINDOW_S = 3  # seconds of completions that make "recovered"
#: the backlog a box slower than the offered rate builds drains after the run
SETTLE_S = float(os.environ.get("CHAOS_SETTLE_S", "300"))
SEED = int(os.environ.get("DUETIME_TEST_SEED") or random.SystemRandom().randrange(1, 2**31))

KILL_SQL = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
    "WHERE datname = current_database() AND application_name LIKE 'duetime%' "
    "AND pid <> pg_backend_pid()"
)
#: Succeeded jobs per whole second since $1 (database clock).
PER_SECOND_SQL = (
    "SELECT floor(extract(epoch FROM finished_at - $1::timestamptz))::int AS s, count(*) AS n "
    "FROM duetime.jobs WHERE status = 'succeeded' AND finished_at >= $1 GROUP BY 1 ORDER BY 1"
)


def rate(per_second: dict[int, int], start: float, end: float) -> float:
    seconds = range(int(start), int(end))
    return sum(per_second.get(s, 0) for s in seconds) / max(1, len(seconds))


@pytest.mark.timeout(BASELINE_S + STORM_S + RECOVERY_S + SETTLE_S + 120)
async def test_connection_kill_storm_recovers(
    tmp_path: Path,
    test_env: dict[str, str],
    migrated_dsn: str,
    amqp_url: str,
    etcd_endpoints: str,
    unique: str,
) -> None:
    print(f"\n[chaos] kill_storm: seed {SEED}")
    c = ChaosCluster(
        scenario="kill_storm",
        seed=SEED,
        soak=SOAK,
        tmp_path=tmp_path,
        base_env=test_env,
        dsn=migrated_dsn,
        amqp_url=amqp_url,
        etcd_endpoint=etcd_endpoints.split(",")[0],
        prefix=f"duetime-test/{unique}",
        queue=f"chaos.kill_storm.{unique}",
        rng=random.Random(f"{SEED}:kill_storm"),
    )
    total_s = BASELINE_S + STORM_S + RECOVERY_S + WINDOW_S
    plan = Plan(jobs=int(RATE * total_s), window=total_s, sleep_ms=(0.0, 5.0), fail_share=0.0)
    async with c:
        c.spawn_replicas(1)
        c.spawn_workers(2)
        await c.wait_ready()
        await c.insert_jobs(plan)
        t0 = await c.db.fetchval("SELECT clock_timestamp()")
        await asyncio.sleep(BASELINE_S)
        storm_at = time.monotonic()
        kills = killed = 0
        c.note(f"kill every duetime backend every {KILL_EVERY_S}s for {STORM_S:.0f}s")
        while time.monotonic() - storm_at < STORM_S:
            killed += await c.db.fetchval(KILL_SQL) if KILLING else 0
            kills += 1
            await asyncio.sleep(max(0.0, storm_at + kills * KILL_EVERY_S - time.monotonic()))
        storm_end = BASELINE_S + (time.monotonic() - storm_at)
        c.note(f"storm over: {kills} rounds, {killed} backends terminated")
        await asyncio.sleep(RECOVERY_S + WINDOW_S)
        per_second = {r["s"]: r["n"] for r in await c.db.fetch(PER_SECOND_SQL, t0)}
        await c.wait_settled(SETTLE_S)
        report = await c.report()

        baseline = rate(per_second, 2, BASELINE_S)  # the first seconds warm up
        during = rate(per_second, BASELINE_S, storm_end)
        after = rate(per_second, storm_end, storm_end + RECOVERY_S)
        zero_seconds_after = sum(
            per_second.get(s, 0) == 0 for s in range(int(storm_end), int(storm_end + RECOVERY_S))
        )
        recovered_after: float | None = None
        for s in range(int(storm_end), int(storm_end + RECOVERY_S) + 1):
            if rate(per_second, s, s + WINDOW_S) >= 0.9 * baseline:
                recovered_after = round(max(0.0, s - storm_end), 1)
                break
        dead = await c.db.fetchval("SELECT count(*) FROM duetime.jobs WHERE status = 'dead'")
        leaders = list(c.cluster.nodes.values())
        uncommitted = sum(
            e.get("published", 0)
            for n in leaders
            for e in n.events("dispatch_commit_failed", "dispatch_interrupted")
        )
        commit_failures = sum(len(n.events("dispatch_commit_failed")) for n in leaders)
        after_commit = sum(
            e.get("published", 0) for n in leaders for e in n.events("dispatch_after_commit")
        )
        figures = {
            "scenario": "kill_storm",
            "seed": SEED,
            "jobs": report.jobs,
            "rate_due_per_s": RATE,
            "kill_rounds": kills if KILLING else 0,
            "backends_terminated": killed,
            "baseline_per_s": round(baseline, 1),
            "storm_per_s": round(during, 1),
            "after_per_s": round(after, 1),
            "zero_seconds_after": zero_seconds_after,
            "recovered_after_s": recovered_after,
            "dead": dead,
            "dispatch_commit_failed": commit_failures,
            "stale_copies_published": uncommitted,
            "published_after_commit": after_commit,
            "skipped_deliveries": report.skipped_deliveries,
            "duplicate_runs": report.duplicate_deliveries,
            "lost": report.lost,
            "problems": report.problems[:3],
        }
        print(f"[chaos] kill_storm {json.dumps(figures)}")
        print("[chaos]   completions per second: " + " ".join(
            f"{s}:{per_second.get(s, 0)}" for s in range(int(BASELINE_S + STORM_S + RECOVERY_S))
        ))  # fmt: skip
        if os.environ.get("CHAOS_TIMELINE") == "1":
            print(await lag_timeline(c.db))
        if SOAK:
            with RESULTS.open("a") as out:
                out.write(json.dumps(figures, default=str) + "\n")
        assert dead == 0, f"{dead} dead jobs\n{c.describe()}"
        assert recovered_after is not None, (
            f"no {WINDOW_S}s window at >= 90% of {baseline:.0f}/s within {RECOVERY_S:.0f}s "
            f"after the storm: {figures}"
        )
        assert report.ok, "\n".join(report.problems) + "\n" + c.describe()
