"""The dashboard's credentials and names (security issue, items 6, 7 and 12), through
the real ASGI application in process, or a real ``duetime dashboard`` process where the
bind matters: nothing a visitor sees is derived from the token, weak tokens are refused
off loopback, wrong tokens are throttled and logged, the ``Host`` must name the
dashboard (DNS rebinding), logout ends the session and CSRF is bound to it, and the
metrics port binds loopback unless told otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode

import asyncpg
import pytest
from structlog.testing import capture_logs

from scheduler.config import Settings
from scheduler.dashboard import Dashboard, create_app
from scheduler.dashboard.auth import Auth
from tests.dashboard.conftest import Cluster, free_port
from tests.support.cli import run_duetime

pytestmark = pytest.mark.timeout(90)

TOKEN = "s3cret-dashboard-token"
HOST = "127.0.0.1:8089"  # the default dashboard_listen


async def call(
    app: Any,
    method: str,
    path: str,
    *,
    host: str = HOST,
    headers: dict[str, str] | None = None,
    form: dict[str, str] | None = None,
    client: str = "127.0.0.1",
) -> tuple[int, dict[str, list[str]], str]:
    """One request through the ASGI app, as uvicorn would send it: (status, headers
    (every value of each), body)."""
    body = urlencode(form).encode() if form is not None else b""
    raw = [(b"host", host.encode())]
    if "Accept" not in (headers or {}):
        raw.append((b"accept", b"text/html"))
    if form is not None:
        raw.append((b"content-type", b"application/x-www-form-urlencoded"))
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    path_only, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path_only, "raw_path": path_only.encode(),
        "query_string": query.encode(), "root_path": "", "headers": raw,
        "client": (client, 50000), "server": ("127.0.0.1", 8089),
    }  # fmt: skip
    sent: list[dict[str, Any]] = []
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    found: dict[str, list[str]] = {}
    for key, value in start["headers"]:
        found.setdefault(key.decode().lower(), []).append(value.decode())
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], found, text.decode()


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match, html[:500]
    return match.group(1)


def session_of(headers: dict[str, list[str]]) -> str:
    for cookie in headers.get("set-cookie", []):
        if cookie.startswith("duetime_session="):
            return cookie.split(";", 1)[0].split("=", 1)[1]
    raise AssertionError(f"no session cookie in {headers}")


@contextlib.asynccontextmanager
async def running(settings: Settings, token: str | None = TOKEN) -> AsyncIterator[Any]:
    dash = Dashboard(settings, Auth.create(token))
    await dash.open()
    try:
        yield create_app(dash)
    finally:
        await dash.close()


async def login(app: Any, csrf_cookie: str = "c00kie") -> str:
    cookie = f"duetime_csrf={csrf_cookie}"
    _, _, page = await call(app, "GET", "/login", headers={"Cookie": cookie})
    status, headers, _ = await call(
        app, "POST", "/login", headers={"Cookie": cookie},
        form={"csrf": csrf_of(page), "token": TOKEN, "next": "/schedules"},
    )  # fmt: skip
    assert status == 303
    return session_of(headers)


# -- item 6: no offline oracle, strong tokens off loopback, throttled failures ---------


async def test_nothing_a_visitor_sees_is_derived_from_the_token(settings: Settings) -> None:
    cookie = {"Cookie": "duetime_csrf=c00kie"}
    seen = []
    for _ in range(2):  # two processes with the same token
        app = create_app(Dashboard(settings, Auth.create(TOKEN)))
        _, _, page = await call(app, "GET", "/login", headers=cookie)
        seen.append(csrf_of(page))
    assert seen[0] != seen[1]  # keyed by a per-process random secret
    for key in (hashlib.sha256(b"duetime-dashboard\0" + TOKEN.encode()).digest(), TOKEN.encode()):
        guess = hmac.new(key, b"csrf:c00kie", hashlib.sha256).hexdigest()
        assert guess not in seen  # the old oracle: HMAC keyed by a hash of the token


async def test_a_weak_token_is_refused_off_loopback(cluster: Cluster) -> None:
    result = await run_duetime(
        {**cluster.env, "DUETIME_DASHBOARD_TOKEN": "a"},
        "dashboard", "--listen", f"0.0.0.0:{free_port()}", timeout=20,
    )  # fmt: skip
    assert result.code == 2
    assert "at least 16" in result.error_line()
    assert "'a'" not in result.error_line()


async def test_wrong_tokens_are_throttled_per_client_and_logged(settings: Settings) -> None:
    app = create_app(Dashboard(settings, Auth.create(TOKEN)))
    wrong = {"Authorization": "Bearer guess-1234", "Accept": "application/json"}
    with capture_logs() as logs:
        codes = [(await call(app, "GET", "/jobs", headers=wrong, client="10.0.0.9"))[0]]
        for _ in range(6):
            codes.append((await call(app, "GET", "/jobs", headers=wrong, client="10.0.0.9"))[0])
    assert codes[:6] == [401] * 6 and codes[6] == 429, codes
    status, headers, _ = await call(
        app, "GET", "/jobs", headers={"Authorization": f"Bearer {TOKEN}"}, client="10.0.0.9"
    )
    assert status == 429 and int(headers["retry-after"][0]) >= 1  # not even compared
    failed = [e for e in logs if e["event"] == "dashboard_auth_failed"]
    assert len(failed) == 6 and failed[-1]["client"] == "10.0.0.9"
    assert failed[-1]["failures"] == 6 and failed[-1]["locked_seconds"] > 0
    assert "guess-1234" not in repr(logs)
    # another address is not locked out by this one, and the login form is throttled too
    status, _, _ = await call(app, "GET", "/jobs", headers=wrong, client="10.0.0.10")
    assert status == 401
    _, _, page = await call(app, "GET", "/login", headers={"Cookie": "duetime_csrf=k"})
    status, headers, body = await call(
        app, "POST", "/login", headers={"Cookie": "duetime_csrf=k"},
        form={"csrf": csrf_of(page), "token": TOKEN, "next": "/"}, client="10.0.0.9",
    )  # fmt: skip
    assert status == 429 and "try again in" in body and headers["retry-after"]


# -- item 7: DNS rebinding ---------------------------------------------------------------


async def test_the_host_must_name_the_dashboard(settings: Settings, unique: str) -> None:
    conn = await asyncpg.connect(settings.database_url)
    job = await conn.fetchval(
        "INSERT INTO duetime.jobs (task, queue, due_at) "
        "VALUES ('rebind.victim', $1, now() + interval '1 day') RETURNING id",
        f"rebind-{unique}",
    )
    try:
        async with running(settings, token=None) as app:  # token-less on loopback: the default
            for host in (HOST, "localhost:8089", "[::1]:8089"):
                status, _, _ = await call(app, "GET", "/healthz", host=host)
                assert status == 200, host
            for host in ("evil.example:8089", "localhost:9999", "127.0.0.1.evil.example:8089"):
                status, _, _ = await call(app, "GET", "/healthz", host=host)
                assert status == 421, host
            # The rebound page (evil.example re-pointed at 127.0.0.1) is same-origin with
            # itself: it reads the confirmation page and its CSRF field, and posts with
            # Origin = Host, which the old check compared.
            rebound = "rebind.evil.example:8089"
            cookie = {"Cookie": "duetime_csrf=k"}
            preview = f"/jobs/bulk?action=cancel&queue=rebind-{unique}"
            status, _, _ = await call(app, "GET", preview, host=rebound, headers=cookie)
            assert status == 421
            _, _, page = await call(app, "GET", preview, headers=cookie)
            form = {"csrf": csrf_of(page), "action": "cancel", "queue": f"rebind-{unique}"}
            for pinned in ("up_to_id", "count", "as_of"):
                form[pinned] = re.findall(rf'name="{pinned}" value="([^"]*)"', page)[0]
            status, _, _ = await call(
                app, "POST", "/jobs/bulk", host=rebound,
                headers={**cookie, "Origin": f"http://{rebound}"}, form=form,
            )  # fmt: skip
            assert status == 421
            # the Origin must name an allowed host even when the Host does
            for origin in ("http://evil.example:8089", "null"):
                status, _, _ = await call(
                    app, "POST", "/jobs/bulk", headers={**cookie, "Origin": origin}, form=form
                )
                assert status == 403, origin
            assert await conn.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job) == (
                "pending"
            )
            status, _, _ = await call(
                app, "POST", "/jobs/bulk", headers={**cookie, "Origin": f"http://{HOST}"},
                form=form,
            )  # fmt: skip
            assert status == 303
            assert await conn.fetchval("SELECT status FROM duetime.jobs WHERE id = $1", job) == (
                "cancelled"
            )
    finally:
        await conn.execute("DELETE FROM duetime.jobs WHERE id = $1", job)
        await conn.close()


async def test_configured_host_names_are_answered(settings: Settings) -> None:
    from dataclasses import replace

    configured = replace(settings, dashboard_hosts=("duetime.internal",))
    app = create_app(Dashboard(configured, Auth.create(TOKEN)))
    status, _, _ = await call(app, "GET", "/healthz", host="duetime.internal")
    assert status == 200
    status, _, _ = await call(app, "GET", "/healthz", host="other.internal")
    assert status == 421


# -- item 12: logout ends the session, CSRF belongs to the session ----------------------


async def test_logout_ends_the_session(settings: Settings) -> None:
    async with running(settings) as app:
        session = await login(app)
        cookies = {"Cookie": f"duetime_csrf=c00kie; duetime_session={session}"}
        status, _, page = await call(app, "GET", "/schedules", headers=cookies)
        assert status == 200
        status, _, _ = await call(
            app, "POST", "/logout", headers=cookies, form={"csrf": csrf_of(page)}
        )
        assert status == 303
        replay = {**cookies, "Accept": "application/json"}
        status, _, _ = await call(app, "GET", "/schedules", headers=replay)
        assert status == 401  # the copied cookie died with the logout


async def test_the_csrf_field_is_bound_to_the_session(settings: Settings) -> None:
    async with running(settings) as app:
        first, second = await login(app), await login(app)  # same browser cookie
        _, _, page = await call(
            app, "GET", "/schedules",
            headers={"Cookie": f"duetime_csrf=c00kie; duetime_session={first}"},
        )  # fmt: skip
        status, _, body = await call(
            app, "POST", "/logout",
            headers={"Cookie": f"duetime_csrf=c00kie; duetime_session={second}"},
            form={"csrf": csrf_of(page)},
        )  # fmt: skip
        assert status == 403 and "CSRF" in body
