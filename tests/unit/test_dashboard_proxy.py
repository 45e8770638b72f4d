"""Which peer's ``X-Forwarded-For`` the dashboard believes: by default nobody's, so a
local process cannot choose the client address the audit log and the throttle record;
with ``DUETIME_DASHBOARD_TRUSTED_PROXIES`` only the proxies named there."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.config import Settings
from scheduler.config.parsers import proxy_addresses
from scheduler.dashboard.server import server_config


async def _client_seen(settings: Settings, peer: str) -> tuple[str, int] | None:
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["client"] = scope.get("client")

    config = server_config(app, settings)
    config.load()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": "/", "raw_path": b"/", "query_string": b"",
        "headers": [(b"host", b"127.0.0.1:8089"), (b"x-forwarded-for", b"203.0.113.9")],
        "client": (peer, 50000), "server": ("127.0.0.1", 8089),
    }  # fmt: skip
    await config.loaded_app(scope, None, None)
    client = seen["client"]
    return (client[0], client[1]) if client else None


async def test_x_forwarded_for_from_loopback_is_ignored_by_default() -> None:
    client = await _client_seen(Settings(), "127.0.0.1")
    assert client is not None and client[0] == "127.0.0.1"


async def test_x_forwarded_for_is_believed_only_from_a_named_proxy() -> None:
    settings = Settings(dashboard_trusted_proxies=("10.0.0.0/24",))
    trusted = await _client_seen(settings, "10.0.0.7")
    assert trusted is not None and trusted[0] == "203.0.113.9"
    untrusted = await _client_seen(settings, "127.0.0.1")
    assert untrusted is not None and untrusted[0] == "127.0.0.1"


def test_trusted_proxies_are_addresses() -> None:
    assert proxy_addresses("127.0.0.1, 10.0.0.0/24,::1,") == ("127.0.0.1", "10.0.0.0/24", "::1")
    assert proxy_addresses("") == ()
    with pytest.raises(ValueError, match="not an IP address"):
        proxy_addresses("proxy.internal")
