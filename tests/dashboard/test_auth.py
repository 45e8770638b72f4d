"""Who may use the dashboard: the token (login form → cookie, or Bearer), the loopback
rule without a token, and the session cookie's attributes, against real processes."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from typing import Any

import pytest
from playwright.async_api import expect

from tests.dashboard.conftest import Cluster, free_port
from tests.support.cli import run_duetime

pytestmark = pytest.mark.timeout(90)

TOKEN = "s3cret-dashboard-token"


def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("location", "")


async def test_token_is_required_by_login_form_or_bearer(cluster: Cluster, page: Any) -> None:
    served = await cluster.start_dashboard(env={"DUETIME_DASHBOARD_TOKEN": TOKEN})
    status, _ = await asyncio.to_thread(fetch, served.url + "/jobs")
    assert status == 401
    status, location = await asyncio.to_thread(fetch, served.url + "/jobs", {"Accept": "text/html"})
    assert (status, location) == (303, "/login?next=%2Fjobs")
    status, _ = await asyncio.to_thread(
        fetch, served.url + "/jobs", {"Authorization": "Bearer wrong"}
    )
    assert status == 401
    status, body = await asyncio.to_thread(
        fetch, served.url + "/jobs", {"Authorization": f"Bearer {TOKEN}"}
    )
    assert status == 200 and "<h1>Jobs " in body
    status, _ = await asyncio.to_thread(fetch, served.url + "/healthz")
    assert status == 200  # liveness stays open for monitoring

    await page.goto(served.url + "/cluster")
    await expect(page).to_have_url(served.url + "/login?next=%2Fcluster")
    await page.fill("input[name=token]", "not it")
    await page.get_by_role("button", name="Log in").click()
    await expect(page.get_by_role("alert")).to_contain_text("not right")
    await page.fill("input[name=token]", TOKEN)
    await page.get_by_role("button", name="Log in").click()
    await expect(page).to_have_url(served.url + "/cluster")
    cookies = {c["name"]: c for c in await page.context.cookies()}
    session = cookies["duetime_session"]
    assert session["httpOnly"] and session["sameSite"] == "Strict"
    assert TOKEN not in session["value"]
    await page.get_by_role("button", name="log out").click()
    await page.goto(served.url + "/jobs")
    await expect(page).to_have_url(served.url + "/login?next=%2Fjobs")


async def test_refuses_a_non_loopback_address_without_a_token(cluster: Cluster) -> None:
    result = await run_duetime(
        cluster.env, "dashboard", "--listen", f"0.0.0.0:{free_port()}", timeout=20
    )
    assert result.code == 2
    assert "without a token" in result.error_line()
