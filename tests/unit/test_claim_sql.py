"""The dispatcher's claim carries its batch size as a literal (see dispatch.sql: with a
``LIMIT $1`` parameter PostgreSQL re-planned the claim on every execution)."""

from __future__ import annotations

import pytest

from scheduler.store.dispatch import claim_sql


def test_limit_is_an_integer_literal_and_nothing_else_is_a_parameter() -> None:
    sql = claim_sql(500)
    code = "\n".join(line for line in sql.splitlines() if not line.startswith("--"))
    assert "LIMIT 500" in code
    assert "{limit}" not in sql
    assert "$" not in code
    assert claim_sql(500) is sql  # one text per batch size: one prepared statement


@pytest.mark.parametrize("bad", [0, -1, 2.5, "500; DROP TABLE duetime.jobs", True, None])
def test_only_positive_integers_reach_the_sql(bad: object) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        claim_sql(bad)  # type: ignore[arg-type]
