"""``duetime workflows show|cancel ID`` as users run it: a real process, real PostgreSQL;
errors are one line, never a traceback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from scheduler import db
from scheduler.store.jobs import JobStore
from scheduler.workflow import chord, step
from tests.conftest import own_database
from tests.support.cli import run_duetime as duetime


@pytest.fixture(scope="module")
async def cli_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, "cliwf") as url:
        yield url


@pytest.fixture(scope="module")
async def pool(cli_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(cli_dsn, min_size=1, max_size=2)
    yield p
    await p.close()


@pytest.fixture
def env(test_env: dict[str, str], cli_dsn: str) -> dict[str, str]:
    return {**test_env, "DUETIME_DATABASE_URL": cli_dsn}


async def test_show_then_cancel_a_workflow(env: dict[str, str], pool: asyncpg.Pool) -> None:
    run = await JobStore(pool).enqueue_workflow(
        chord([step("t.member", delay=3600) for _ in range(2)], step("t.callback"))
    )
    wid = str(run.workflow_id)
    shown = await duetime(env, "workflows", "show", wid)
    assert shown.code == 0, shown
    assert f"workflow {wid}: 3 job(s): 2 pending, 1 waiting" in shown.out
    callback_line = next(line for line in shown.out.splitlines() if "t.callback" in line)
    assert f"{run.ids[0]},{run.ids[1]}" in callback_line and "waiting" in callback_line
    as_json = (await duetime(env, "workflows", "show", wid, "--json")).json()
    assert isinstance(as_json, list)
    assert [j["id"] for j in as_json] == run.ids
    cancelled = await duetime(env, "workflows", "cancel", wid)
    assert (
        cancelled.code == 0 and f"cancelled 3 unfinished job(s) of workflow {wid}" in cancelled.out
    )
    shown = await duetime(env, "workflows", "show", wid)
    assert "3 job(s): 3 cancelled" in shown.out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("workflows", "show", "987654321"), "no workflow 987654321"),
        (("workflows", "cancel", "987654321"), "no workflow 987654321"),
        (("workflows", "show", "abc"), "must be an integer"),
        (("workflows", "show", "0"), "between 1 and"),
    ],
)
async def test_errors_are_one_line(env: dict[str, str], args: tuple[str, ...], needle: str) -> None:
    run = await duetime(env, *args)
    assert run.code != 0
    assert needle in run.error_line()
