"""Rows and requests anyone can send do not break the dashboard (security issue, items 3
and 4): a payload nested 3,000 deep renders as a bounded note on every page that shows
its row; a non-ASCII cookie or CSRF field is refused (401/403), never an HTTP 500; and
the 500 page, for whatever still fails, carries the same security headers as the rest."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest

from scheduler.config import Settings
from scheduler.dashboard import Dashboard, create_app, pages
from scheduler.dashboard.auth import Auth
from tests.dashboard.conftest import Cluster

pytestmark = pytest.mark.timeout(90)

#: 24 KB of JSON nested 3,000 deep: valid jsonb, deeper than Python's parser goes.
DEEP = '{"key":' * 3000 + "1" + "}" * 3000
TOKEN = "s3cret-dashboard-token"
HEADERS = ("content-security-policy", "x-content-type-options", "x-frame-options")


def request(
    url: str, *, headers: dict[str, str] | None = None, data: bytes | None = None
) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) without following redirects."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with opener.open(req, timeout=10) as response:
            found = {k.lower(): v for k, v in response.headers.items()}
            return response.status, found, response.read().decode()
    except urllib.error.HTTPError as exc:
        found = {k.lower(): v for k, v in exc.headers.items()}
        return exc.code, found, exc.read().decode(errors="replace")


async def test_a_payload_nested_3000_deep_renders_on_every_page(cluster: Cluster) -> None:
    pool = cluster.pool
    dead = await pool.fetchval(
        "INSERT INTO duetime.jobs (task, queue, payload, status, last_error, finished_at) "
        "VALUES ('deep.dead', $1, $2::text::jsonb, 'dead', 'x', now()) RETURNING id",
        cluster.queue,
        DEEP,
    )
    # overdue and pending: the overview shows the oldest overdue job too (never claimed:
    # this module's tests run no scheduler, and the queue has no worker)
    overdue = await pool.fetchval(
        "INSERT INTO duetime.jobs (task, queue, payload, due_at) "
        "VALUES ('deep.pending', $1, $2::text::jsonb, now() - interval '1 hour') RETURNING id",
        cluster.queue,
        DEEP,
    )
    served = await cluster.start_dashboard()
    try:
        for path in ("/", "/jobs", "/jobs?status=dead", f"/jobs/{dead}", f"/jobs/{overdue}"):
            status, headers, body = await asyncio.to_thread(request, served.url + path)
            assert status == 200, (path, status, body[:300])
            assert "Traceback" not in body and "RecursionError" not in body.split("not shown")[0]
            for name in HEADERS:
                assert name in headers, (path, name)
        _, _, body = await asyncio.to_thread(request, f"{served.url}/jobs/{dead}")
        assert "(duetime: not shown)" in body
        assert "JSON the client cannot decode (RecursionError)" in body
        assert len(body) < 60_000
    finally:
        await pool.execute("DELETE FROM duetime.jobs WHERE id = ANY($1::bigint[])", [dead, overdue])


async def test_the_job_page_shows_a_unique_key_escaped_and_the_priority(
    cluster: Cluster,
) -> None:
    pool = cluster.pool
    job = await pool.fetchval(
        "INSERT INTO duetime.jobs (task, queue, unique_key, due_at, priority) "
        "VALUES ('uk.shown', $1, '<b>uk</b>', now() + interval '1 day', -42) RETURNING id",
        cluster.queue,
    )
    served = await cluster.start_dashboard()
    try:
        status, _, body = await asyncio.to_thread(request, f"{served.url}/jobs/{job}")
        assert status == 200
        assert "<code>&lt;b&gt;uk&lt;/b&gt;</code>" in body and "<b>uk</b>" not in body
        assert '<dt>priority</dt><dd data-testid="job-priority">-42</dd>' in body
    finally:
        await pool.execute("DELETE FROM duetime.jobs WHERE id = $1", job)


async def test_non_ascii_cookies_and_csrf_fields_are_refused_not_500(cluster: Cluster) -> None:
    served = await cluster.start_dashboard(env={"DUETIME_DASHBOARD_TOKEN": TOKEN})
    url = served.url
    for cookie in ("duetime_session=é.1.2", "duetime_session=1.2.é", "duetime_csrf=é"):
        status, headers, body = await asyncio.to_thread(
            request, url + "/jobs", headers={"Cookie": cookie}
        )
        assert status == 401, (cookie, status, body[:300])
        assert "Traceback" not in body
        assert all(name in headers for name in HEADERS)
    # the login form's CSRF check, with a non-ASCII field and/or cookie
    for cookie, field in (("duetime_csrf=abc", "é"), ("duetime_csrf=é", "é"), ("", "é")):
        form = urllib.parse.urlencode({"csrf": field, "token": "x", "next": "/"}).encode()
        status, headers, body = await asyncio.to_thread(
            request,
            url + "/login",
            data=form,
            headers={"Cookie": cookie, "Content-Type": "application/x-www-form-urlencoded"},
        )
        assert status == 403, (cookie, field, status, body[:300])
        assert "Traceback" not in body
        assert all(name in headers for name in HEADERS)
    # a Bearer token that is not ASCII is a wrong token
    status, _, _ = await asyncio.to_thread(
        request, url + "/jobs", headers={"Authorization": "Bearer é"}
    )
    assert status == 401


async def _get(app: Any, path: str) -> tuple[int, dict[str, str], str]:
    """One GET through the ASGI app, in process (what uvicorn would do)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"127.0.0.1:8089"), (b"accept", b"text/html")],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8089),
    }  # fmt: skip
    sent: list[dict[str, Any]] = []
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with contextlib.suppress(RuntimeError):  # Starlette re-raises it for the server's log
        await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, body.decode()


async def test_the_500_page_carries_the_security_headers(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(dash: Dashboard, request: Any) -> Any:
        raise RuntimeError("boom: an unexpected bug with a detail password=hunter2")

    monkeypatch.setattr(pages, "cluster", broken)
    app = create_app(Dashboard(settings, Auth.create(None)))
    status, headers, body = await _get(app, "/cluster")
    assert status == 500
    for name in HEADERS:
        assert name in headers, (name, headers)
    assert headers["x-frame-options"] == "DENY"
    assert "Internal error" in body
    assert "boom" not in body and "hunter2" not in body and "Traceback" not in body
