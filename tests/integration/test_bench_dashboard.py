"""``duetime bench dashboard --quick`` loads, shapes and times every overview statement.

A benchmark, not a timed test: it asserts the scenario ran every statement the overview
and the job list use (so a renamed statement cannot silently drop out of the numbers in
docs/dashboard.md), never how fast they were.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scheduler.sql import load
from tests.support.cli import run_duetime
from tests.support.procs import REPO_ROOT

pytestmark = pytest.mark.timeout(120)


async def test_bench_dashboard_quick_times_every_statement(
    server_dsn: str, amqp_url: str, etcd_endpoints: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
    env.update(DUETIME_AMQP_URL=amqp_url, DUETIME_ETCD_ENDPOINTS=etcd_endpoints)
    code, out, err = await run_duetime(
        env, "bench", "dashboard", "--quick", "--results-dir", str(tmp_path),
        "--server-url", server_dsn, timeout=100, cwd=REPO_ROOT,
    )  # fmt: skip
    assert code == 0, f"stdout:\n{out[-2000:]}\nstderr:\n{err[-2000:]}"
    result = json.loads(out.strip().splitlines()[-1])
    assert result["scenario"] == "dashboard" and result["stored_jobs"] == 20_000
    overview = {k.removeprefix("status.") for k in result["overview_statements"]}
    read_models = set(load("dashboard")) - {
        "terminal_counts", "ledger_row", "schedule_name",  # exact path / job page only
        "jobs_page", "state_page", "tag_matches",  # the job list's pages
    }  # fmt: skip
    assert read_models <= overview, read_models - overview
    assert result["ledger_rows_last_hour"] > 0
    pages = result["jobs_page_first_page"]
    assert {"no filter", "status=pending", "status=dead"} <= set(pages)
    assert all(t["p50_ms"] > 0 for t in [*result["overview_statements"].values(),
                                         *pages.values()])  # fmt: skip
    assert (tmp_path / "dashboard.jsonl").read_text().strip()
