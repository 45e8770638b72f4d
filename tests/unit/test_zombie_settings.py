"""Settings that keep a frozen leader from holding the fence: defaults, derived values,
validation against the lease TTL, and the session settings scheduler pools carry."""

from __future__ import annotations

import pytest

from scheduler.config import load_settings
from scheduler.errors import ConfigError
from scheduler.leadership.policy import session_settings


def test_defaults_derive_from_the_lease_ttl() -> None:
    s = load_settings(env={"DUETIME_LEASE_TTL": "4"})
    assert s.fence_takeover_grace == 1.0
    assert s.effective_statement_timeout == 4.0
    assert s.effective_tcp_user_timeout == 4.0
    assert session_settings(s) == {
        "idle_in_transaction_session_timeout": "4000ms",
        "statement_timeout": "4000ms",
        "tcp_user_timeout": "4000ms",
    }


def test_explicit_values_and_tcp_user_timeout_off() -> None:
    s = load_settings(
        env={
            "DUETIME_LEASE_TTL": "10",
            "DUETIME_SCHEDULER_STATEMENT_TIMEOUT": "2.5",
            "DUETIME_SCHEDULER_TCP_USER_TIMEOUT": "0",
            "DUETIME_FENCE_TAKEOVER_GRACE": "0",
        }
    )
    assert s.effective_statement_timeout == 2.5
    assert s.fence_takeover_grace == 0.0
    assert session_settings(s) == {
        "idle_in_transaction_session_timeout": "10000ms",
        "statement_timeout": "2500ms",
    }


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DUETIME_SCHEDULER_STATEMENT_TIMEOUT": "11"}, "must be at most lease_ttl 10.0"),
        ({"DUETIME_SCHEDULER_STATEMENT_TIMEOUT": "0"}, "must be > 0.0"),
        ({"DUETIME_SCHEDULER_TCP_USER_TIMEOUT": "-1"}, "must be >= 0.0"),
        ({"DUETIME_FENCE_TAKEOVER_GRACE": "10"}, "must be smaller than lease_ttl 10.0"),
        ({"DUETIME_FENCE_TAKEOVER_GRACE": "soon"}, "must be a float"),
    ],
)
def test_bad_values_are_refused_with_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={"DUETIME_LEASE_TTL": "10", **env})
    assert message in str(info.value)
    assert "\n" not in str(info.value)
