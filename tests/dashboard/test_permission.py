"""A PostgreSQL permission error is not an outage: the dashboard answers 403
"permission denied: …" with its security headers, never 503 "PostgreSQL unavailable"
(docs/security.md)."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from scheduler.config import Settings
from scheduler.store.jobs import JobStore
from tests.dashboard.test_security import call, running

pytestmark = pytest.mark.timeout(90)


async def test_a_permission_error_is_403_permission_denied_not_unavailable(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def denied(self: JobStore, *args: Any, **kwargs: Any) -> Any:
        raise asyncpg.InsufficientPrivilegeError("permission denied for table jobs")

    monkeypatch.setattr(JobStore, "get", denied)
    async with running(settings, token=None) as app:
        status, headers, body = await call(app, "GET", "/jobs/1")
    assert status == 403, body[:300]
    assert "permission denied: " in body and "permission denied for table jobs" in body
    assert "unavailable" not in body
    assert "default-src" in headers["content-security-policy"][0]
    assert headers["x-frame-options"] == ["DENY"]
    assert headers["x-content-type-options"] == ["nosniff"]
