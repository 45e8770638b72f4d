"""Statements composed from shared fragments (``scheduler.sql.compose``) come out whole:
every placeholder filled, comments untouched."""

from __future__ import annotations

import pytest

from scheduler.sql import compose, load
from scheduler.store import dashboard, dispatch, jobs, schedules

COMPOSED = {
    "dispatch.claim": dispatch.claim_sql(500),
    "dispatch.claim_ids": dispatch.claim_sql(500, "id"),
    "dispatch.claimed_row": dispatch.CLAIMED_ROW,
    "dispatch.lock_stalled": dispatch.LOCK_STALLED,
    "dispatch.lock_stalled_ids": dispatch.LOCK_STALLED_IDS,
    "dispatch.stalled_row": dispatch.STALLED_ROW,
    "schedules.claim_due": schedules.CLAIM_DUE,
    "schedules.claim_due_ids": schedules.CLAIM_DUE_IDS,
    "schedules.claimed_schedule": schedules.CLAIMED_SCHEDULE,
    **{f"jobs.list.tagged={tagged}": sql for tagged, sql in jobs.LIST.items()},
    **{
        f"jobs.{name}.tagged={tagged}": compose(
            "jobs", name, states="status = 'pending'", filter=jobs.FILTERS[tagged]
        )
        for name in ("matching", "matching_ids")
        for tagged in (False, True)
    },
    **{
        f"dashboard.page.{state}.tagged={tagged}": sql
        for (state, tagged), sql in dashboard.PAGES.items()
    },
}


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_every_placeholder_is_filled(name: str) -> None:
    code = [line for line in COMPOSED[name].splitlines() if not line.lstrip().startswith("--")]
    assert not [line for line in code if "{" in line or "}" in line], name
    assert code[-1].endswith(";")


def test_comments_are_left_as_written() -> None:
    sql = compose("dispatch", "claim", columns="id", limit="7")
    comments = [line for line in sql.splitlines() if line.startswith("--")]
    original = [line for line in load("dispatch")["claim"].splitlines() if line.startswith("--")]
    assert comments == original


def test_format_paramstyle_serves_dbapi_drivers_from_the_same_text() -> None:
    """The sync producers (scheduler.store.sync_jobs) run jobs.sql's own statements:
    comments (which name $n) dropped, % doubled, $n made %s with the argument order."""
    from scheduler.sql import format_paramstyle, load

    text, order = format_paramstyle("-- $9 is a comment, 50%\nSELECT $2, '5%', $1, $2")
    assert text == "SELECT %s, '5%%', %s, %s" and order == (1, 0, 1)
    insert, order = format_paramstyle(load("jobs")["insert"])
    assert "$" not in insert and "--" not in insert and insert.count("%s") == 11
    assert order == tuple(range(11))
    unique, order = format_paramstyle(load("jobs")["insert_unique"])
    assert order == tuple(range(14)) and "duetime.enqueue_unique(" in unique
