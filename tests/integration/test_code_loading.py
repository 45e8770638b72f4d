"""Which code a ``duetime`` command loads: its own, the ``--import`` modules, nothing else.

A service's working directory holds whatever the operator or an application put there.
A hostile ``bench/__init__.py`` in it (it writes a marker file and exits 99) must not
run when a command builds its parser or when a worker starts; ``duetime bench`` itself
loads the benchmarks of the checkout the ``scheduler`` package comes from, whatever the
current directory holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import run_duetime
from tests.support.procs import Processes, duetime_argv
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(60)

HOSTILE = """\
import pathlib, sys
pathlib.Path(__file__).resolve().parents[1].joinpath("HOSTILE_RAN").write_text("ran")
print("hostile bench package imported")
sys.exit(99)
"""

TASKS = """\
from workers import JobContext, task


@task("code_loading.noop")
async def noop(ctx: JobContext, payload: dict) -> None:
    return None
"""


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    """An application directory: its own task module next to a hostile ``bench/``."""
    app = tmp_path / "app"
    (app / "bench").mkdir(parents=True)
    (app / "bench" / "__init__.py").write_text(HOSTILE)
    (app / "bench" / "cli.py").write_text(HOSTILE)
    (app / "code_loading_tasks.py").write_text(TASKS)
    return app


def ran(app: Path) -> bool:
    return (app / "HOSTILE_RAN").exists()


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["status", "--help"], ["worker", "--help"], ["scheduler", "--help"]],
    ids=" ".join,
)
async def test_help_from_a_directory_with_a_bench_package_runs_none_of_it(
    app_dir: Path, test_env: dict[str, str], argv: list[str]
) -> None:
    result = await run_duetime(test_env, *argv, cwd=app_dir)
    assert result.code == 0, result.err
    assert "hostile" not in result.out + result.err
    assert not ran(app_dir)


async def test_bench_loads_the_checkouts_benchmarks_not_the_working_directorys(
    app_dir: Path, test_env: dict[str, str]
) -> None:
    result = await run_duetime(test_env, "bench", "--help", cwd=app_dir)
    assert result.code == 0, result.err
    scenarios = (
        "{baseline,worker,io,storm,steady,coldstart,recurring,scale,"
        "dashboard,shards,shardsim,cronstorm,all}"
    )
    assert scenarios in result.out  # the checkout's
    assert not ran(app_dir)


async def test_worker_starts_from_a_directory_with_a_bench_package_without_running_it(
    app_dir: Path, procs: Processes, test_env: dict[str, str], unique: str
) -> None:
    env = {**test_env, "DUETIME_NODE_ID": f"w-{unique}", "DUETIME_LOG_LEVEL": "info"}
    worker = procs.spawn(
        duetime_argv("worker", "--import", "code_loading_tasks", "--queue", f"q{unique}"),
        name="worker",
        env=env,
        cwd=app_dir,
    )

    def started() -> bool:
        assert worker.running(), worker.tail()
        lines = [json.loads(x) for x in worker.output().splitlines() if x.startswith("{")]
        return any(e.get("event") == "worker_started" for e in lines)

    await wait_for(started, timeout=30, message="worker_started")
    assert not ran(app_dir)
    assert await worker.stop(10) == 0, worker.tail()
    assert "hostile" not in worker.output()
