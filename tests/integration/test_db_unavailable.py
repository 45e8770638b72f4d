"""A DSN whose hosts match none of its ``target_session_attrs`` is "database unavailable".

The server here is a primary, so ``target_session_attrs=read-only`` finds no matching host,
the same answer asyncpg gives a ``read-write`` DSN while a Patroni switchover has no
primary yet. ``scheduler.db`` must report it as a transient ``ServiceUnavailable`` (the
start-up retry waits it out), not let asyncpg's error escape as a crash.
"""

from __future__ import annotations

import pytest

from scheduler import db
from scheduler.errors import ServiceUnavailable
from scheduler.startup import is_transient

pytestmark = pytest.mark.timeout(30)


def _no_matching_host(dsn: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}target_session_attrs=read-only"


async def test_connect_without_a_matching_host_is_transient(dsn: str) -> None:
    with pytest.raises(ServiceUnavailable) as caught:
        await db.connect(_no_matching_host(dsn), timeout=5)
    assert caught.value.transient
    assert is_transient(caught.value)
    assert "TargetServerAttributeNotMatched" in str(caught.value)


async def test_pool_without_a_matching_host_is_transient(dsn: str) -> None:
    with pytest.raises(ServiceUnavailable) as caught:
        await db.create_pool(_no_matching_host(dsn), min_size=1, max_size=1, timeout=5)
    assert caught.value.transient
