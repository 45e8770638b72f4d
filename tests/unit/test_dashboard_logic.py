"""The dashboard's pure parts: charts, lag percentiles, DST marks, payload caps, and the
auth primitives (session cookie, CSRF, loopback rule)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from scheduler.config import load_settings
from scheduler.cron import parse_cron
from scheduler.dashboard import charts, present
from scheduler.dashboard.auth import (
    SESSION_TTL,
    Auth,
    Sessions,
    check_listen,
    is_loopback,
    local_path,
)
from scheduler.dashboard.hosts import Hosts
from scheduler.dashboard.throttle import Throttle
from scheduler.errors import ConfigError
from scheduler.planning import CronTiming

NEW_YORK = ZoneInfo("America/New_York")


def test_charts_escape_text_and_scale_to_the_data() -> None:
    svg = charts.line_chart(
        {"<p50>": [(0, 0.2), (1, 0.4)]}, minutes=60, title="<script>x</script>", unit="s"
    )
    assert "<script>" not in svg and "&lt;script&gt;" in svg
    assert "&lt;p50&gt;" in svg and "<polyline" in svg
    bars = charts.bar_chart({0: 120, 5: 30, 70: 9}, minutes=60, title="t")
    assert bars.count("<rect") == 2  # minute 70 is outside the window
    assert ">200<" in bars  # axis rounded up from 120 to 200


def test_lag_windows_and_per_minute_series() -> None:
    samples = [(0, 0.01), (0, 0.03), (2, 0.02), (10, 5.0), (59, 1.0)]
    five = present.lag_window(samples, 5)
    assert (five.samples, five.p50) == (3, 0.02)
    hour = present.lag_window(samples, 60)
    assert hour.samples == 5 and hour.p99 == 5.0
    assert present.lag_window([], 5).p50 is None
    series = present.lag_per_minute(samples)
    assert [m for m, _ in series["p50"]] == [0, 2, 10, 59]


def fires(expr: str, tz: str, start: datetime, count: int) -> list[present.FireTime]:
    timing = CronTiming(parse_cron(expr, tz))
    out = []
    for instant in timing.iter_from(start):
        out.append(instant)
        if len(out) == count:
            break
    return present.fire_times(out, ZoneInfo(tz))


def test_dst_gap_and_repeat_are_marked() -> None:
    spring = fires("30 2 * * *", "America/New_York", datetime(2026, 3, 6, 12, tzinfo=UTC), 3)
    assert [f.mark for f in spring] == [None, "gap", None]
    assert spring[1].local.strftime("%H:%M %Z") == "03:00 EDT"  # right after the gap
    fall = fires("30 1 * * *", "America/New_York", datetime(2026, 10, 30, 12, tzinfo=UTC), 3)
    assert [f.mark for f in fall] == [None, "repeat", None]
    assert fall[1].utc == datetime(2026, 11, 1, 5, 30, tzinfo=UTC)  # the first 01:30
    assert "twice" in fall[1].note


def test_payloads_and_errors_are_capped() -> None:
    text, cut = present.pretty_json({"a": "x" * 50_000})
    assert cut and len(text) == present.PAYLOAD_CAP
    assert present.pretty_json({"a": 1}) == ('{\n  "a": 1\n}', False)
    assert present.capped("e" * 5000)[1] and present.capped(None) == ("", False)


def test_sessions_are_remembered_expire_and_end_at_logout() -> None:
    auth = Auth.create("tok")
    cookie = auth.new_session(now=1000.0)
    assert "tok" not in cookie and len(cookie) >= 40  # a random id, nothing derived
    assert auth.session_ok(cookie, now=1000.0 + SESSION_TTL - 1)
    assert not auth.session_ok(cookie + "x", now=1001.0)  # tampered
    assert not Auth.create("tok").session_ok(cookie, now=1000.0)  # another process
    assert auth.end_session(cookie) and not auth.session_ok(cookie, now=1001.0)
    later = auth.new_session(now=1000.0)
    assert not auth.session_ok(later, now=1000.0 + SESSION_TTL + 1)
    assert auth.bearer_ok("Bearer tok") and not auth.bearer_ok("Bearer to")
    assert not Auth.create(None).bearer_ok("Bearer tok")


def test_sessions_and_the_throttle_are_bounded() -> None:
    sessions = Sessions(limit=3)
    ids = [sessions.issue(0.0) for _ in range(5)]
    assert len(sessions) == 3 and not sessions.valid(ids[0], 1.0) and sessions.valid(ids[4], 1.0)
    throttle = Throttle(limit=3)
    for n in range(10):
        throttle.failed(f"10.0.0.{n}", 0.0)
    assert len(throttle) == 3


def test_the_throttle_backs_off_exponentially_and_forgives() -> None:
    throttle = Throttle(free=2, base=1.0, ceiling=8.0, forget=100.0)
    locks = [throttle.failed("a", 0.0)[1] for _ in range(7)]
    assert locks == [0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert throttle.retry_after("a", 3.0) == 5.0 and throttle.retry_after("b", 3.0) == 0.0
    assert throttle.retry_after("a", 200.0) == 0.0  # silent for longer than forget
    throttle.failed("c", 0.0)
    throttle.succeeded("c")
    assert throttle.retry_after("c", 0.0) == 0.0


def test_csrf_token_is_bound_to_its_binding() -> None:
    auth = Auth.create(None)
    cookie = auth.new_csrf_cookie()
    token = auth.csrf_token(f"cookie:{cookie}")
    assert auth.csrf_ok(f"cookie:{cookie}", token)
    assert not auth.csrf_ok(f"cookie:{auth.new_csrf_cookie()}", token)
    assert not auth.csrf_ok(f"session:{cookie}", token)
    assert not auth.csrf_ok(f"cookie:{cookie}", None) and not auth.csrf_ok(None, token)


def test_host_names_the_dashboard_answers_to() -> None:
    loop = Hosts.for_listen("127.0.0.1", 8089)
    assert all(loop.allows(h) for h in ("127.0.0.1:8089", "localhost:8089", "[::1]:8089"))
    assert not any(loop.allows(h) for h in ("evil:8089", "localhost", "", None, "a b:8089"))
    wild = Hosts.for_listen("0.0.0.0", 8089, ("duetime.internal", "ops.internal:8443"))
    assert wild.allows("10.1.2.3:8089") and wild.allows("duetime.internal")
    assert wild.allows("ops.internal:8443") and not wild.allows("ops.internal:9000")
    assert not wild.allows("evil.example:8089") and not wild.allows("localhost:8089")
    assert wild.allows_origin("https://duetime.internal") and not wild.allows_origin("null")
    assert Hosts.for_listen("10.0.0.5", 80).allows("10.0.0.5")  # port 80 implied


def test_non_loopback_needs_a_token() -> None:
    assert check_listen("127.0.0.1:8089", None) == ("127.0.0.1", 8089)
    assert check_listen("[::1]:9000", None) == ("::1", 9000)
    assert is_loopback("localhost") and not is_loopback("10.0.0.5")
    with pytest.raises(ConfigError, match="without a token"):
        check_listen("0.0.0.0:8089", None)
    with pytest.raises(ConfigError, match="at least 16"):
        check_listen("0.0.0.0:8089", "tok")
    assert check_listen("0.0.0.0:8089", "t" * 16) == ("0.0.0.0", 8089)
    assert check_listen("127.0.0.1:8089", "a") == ("127.0.0.1", 8089)  # loopback: any


def test_dashboard_token_is_a_redacted_secret_and_a_credential(tmp_path: Path) -> None:
    (tmp_path / "dashboard_token").write_text("tok-from-credential\n")
    settings = load_settings(
        env={"CREDENTIALS_DIRECTORY": str(tmp_path), "DUETIME_DASHBOARD_LISTEN": "[::1]:9001"}
    )
    assert settings.dashboard_token == "tok-from-credential"
    assert settings.dashboard_listen == "[::1]:9001"
    assert "tok-from-credential" not in repr(settings)
    assert settings.redacted()["dashboard_token"] == "***"
    with pytest.raises(ConfigError, match="must be host:port"):
        load_settings(env={"DUETIME_DASHBOARD_LISTEN": "8089"})


def test_login_redirect_stays_on_this_site() -> None:
    assert local_path("/jobs?status=dead") == "/jobs?status=dead"
    for hostile in ("//evil.example/", "/\\evil.example", "https://evil.example/", "", "jobs"):
        assert local_path(hostile) == "/", hostile


def test_queue_counts_merge_live_and_terminal_states() -> None:
    from scheduler.store.rows import QueueStatus

    live = [QueueStatus("b", pending=3, due_now=1, dispatched=2, dead_last_hour=1)]
    rows, totals = present.queue_counts(live, {("a", "succeeded"): 5, ("b", "dead"): 2}, exact=True)
    assert [r["queue"] for r in rows] == ["a", "b"]
    assert rows[0] == {"queue": "a", "pending": 0, "due_now": 0, "dispatched": 0,
                       "dead_last_hour": 0, "succeeded": 5, "dead": 0, "cancelled": 0,
                       "declared": True}  # fmt: skip
    assert totals["pending"] == 3 and totals["dead"] == 2 and totals["succeeded"] == 5
    rows, totals = present.queue_counts(live, {("*", "succeeded"): 10**7}, exact=False)
    assert rows[0]["succeeded"] is None and totals["succeeded"] == 10**7


def test_queue_counts_mark_an_undeclared_queue_held() -> None:
    """The overview's row of a queue not in duetime.queues says its jobs are held."""
    from scheduler.store.rows import QueueStatus

    live = [QueueStatus("x", pending=2, due_now=1), QueueStatus("y", pending=2, declared=False)]
    rows, _ = present.queue_counts(live, {}, exact=True)
    assert [(r["queue"], r["declared"]) for r in rows] == [("x", True), ("y", False)]
    assert live[1].held == 0 and QueueStatus("z", due_now=4, declared=False).held == 4
