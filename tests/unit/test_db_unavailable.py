"""Every place that classifies database errors agrees on what "unavailable" means.

``TargetServerAttributeNotMatched`` is what asyncpg raises for a multi-host DSN with
``target_session_attrs=read-write`` while no host is writable (a Patroni switchover):
waiting fixes it, so it must be retried everywhere, never blamed on a row or taken for a
refusal.
"""

from __future__ import annotations

import asyncpg
import pytest

from scheduler.db import DB_REFUSED, DB_UNAVAILABLE
from scheduler.startup import is_permanent_cause, is_transient
from workers.errors import CONNECTION_ERRORS
from workers.executor import _UNAVAILABLE

NO_WRITABLE_HOST = asyncpg.TargetServerAttributeNotMatched(
    "None of the hosts match the target attribute requirement read-write"
)


def test_no_writable_host_is_transient_at_start() -> None:
    assert is_transient(NO_WRITABLE_HOST)
    assert not is_permanent_cause(NO_WRITABLE_HOST)


@pytest.mark.parametrize(
    "classes", [DB_UNAVAILABLE, CONNECTION_ERRORS, _UNAVAILABLE], ids=["db", "groups", "executor"]
)
def test_no_writable_host_is_unavailable_in_the_worker(
    classes: tuple[type[BaseException], ...],
) -> None:
    assert isinstance(NO_WRITABLE_HOST, classes)


def test_unavailable_and_refused_do_not_overlap() -> None:
    for exc in (NO_WRITABLE_HOST, asyncpg.CannotConnectNowError("starting up"), TimeoutError()):
        assert isinstance(exc, DB_UNAVAILABLE)
        assert not isinstance(exc, DB_REFUSED)
    assert isinstance(asyncpg.InvalidPasswordError("no"), DB_REFUSED)
    assert not isinstance(asyncpg.InvalidPasswordError("no"), DB_UNAVAILABLE)
