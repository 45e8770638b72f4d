"""``duetime bench all --quick`` runs every scenario end to end and loses nothing.

Benchmarks, not timed tests: this asserts completeness only (every job ran, no duplicate
effect, every expected fire time delivered, every result line and plot written), never
speed. It runs the real CLI as a child process against the session's services, with
results in a temporary directory so the committed bench/results stay untouched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.cli import run_duetime
from tests.support.procs import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

SCENARIOS = {"baseline", "worker", "io", "storm", "steady", "coldstart", "recurring", "scale"}


async def test_bench_all_quick_is_complete(
    server_dsn: str, amqp_url: str, etcd_endpoints: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUETIME_")}
    env.update(DUETIME_AMQP_URL=amqp_url, DUETIME_ETCD_ENDPOINTS=etcd_endpoints)
    code, out, err = await run_duetime(
        env, "bench", "all", "--quick", "--results-dir", str(tmp_path),
        "--server-url", server_dsn, timeout=270, cwd=REPO_ROOT,
    )  # fmt: skip
    detail = f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert code == 0, detail
    results = {r["scenario"]: r for r in map(json.loads, out.splitlines())}
    assert set(results) == SCENARIOS, detail
    assert all(r["quick"] for r in results.values())

    base = results["baseline"]
    assert base["pipeline"]["consumed"] == base["params"]["jobs"]
    for name in ("storm", "steady"):
        r = results[name]
        assert r["completed_pct"] == 100.0, r
        assert r["jobs_started"] == r["completed"], r
        assert r["duplicates"] == 0, r
    work = results["worker"]
    assert work["targets"]["complete"], work
    assert results["io"]["targets"]["complete"], results["io"]
    cold = results["coldstart"]
    assert cold["completed"] == cold["jobs"], cold
    rec = results["recurring"]
    if "skipped" not in rec:
        assert rec["missing"] == 0 and rec["duplicates"] == 0, rec
    scale = results["scale"]
    assert scale["dispatch"]["dispatched"] == scale["params"]["probe"], scale

    for name in SCENARIOS:
        assert (tmp_path / f"{name}.jsonl").read_text().strip(), name
        assert (tmp_path / f"{name}-quick.png").stat().st_size > 0, name
