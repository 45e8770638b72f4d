"""The trust window arithmetic of ``scheduler.leadership.lease``, without etcd."""

from __future__ import annotations

import pytest

from scheduler.errors import ConfigError
from scheduler.leadership.etcd_client import parse_endpoint
from scheduler.leadership.lease import LeaseDeadline, default_safety_margin
from tests.support.election import SingleKey


def test_never_renewed_is_expired() -> None:
    deadline = LeaseDeadline(ttl=10, safety_margin=2)
    assert deadline.valid_until is None
    assert deadline.expired(0.0)
    assert deadline.remaining(0.0) == 0.0


def test_window_is_ttl_minus_margin_from_send_time() -> None:
    deadline = LeaseDeadline(ttl=10, safety_margin=2)
    deadline.renewed(sent_at=100.0)
    assert deadline.valid_until == 108.0
    assert not deadline.expired(107.999)
    assert deadline.expired(108.0)  # fail closed at the boundary itself
    assert deadline.remaining(105.0) == pytest.approx(3.0)
    assert deadline.remaining(200.0) == 0.0


def test_slow_reply_does_not_stretch_the_window() -> None:
    """The reply came 1.5 s after the request: trust counts from the request."""
    deadline = LeaseDeadline(ttl=2, safety_margin=0.5)
    sent_at, replied_at = 10.0, 11.5
    deadline.renewed(sent_at)
    assert deadline.valid_until == 11.5
    assert deadline.expired(replied_at)  # nothing left to trust by the time it arrived


def test_stale_reply_neither_shrinks_nor_extends() -> None:
    deadline = LeaseDeadline(ttl=10, safety_margin=2)
    deadline.renewed(sent_at=20.0)
    assert deadline.valid_until == 28.0
    # A reply to an older request (sent at 15) arrives late: no effect.
    deadline.renewed(sent_at=15.0)
    assert deadline.valid_until == 28.0
    # A newer one extends exactly to its own send time + ttl - margin.
    deadline.renewed(sent_at=23.0)
    assert deadline.valid_until == 31.0


def test_granted_ttl_smaller_than_configured_wins() -> None:
    deadline = LeaseDeadline(ttl=10, safety_margin=2)
    deadline.renewed(sent_at=0.0, granted_ttl=5)
    assert deadline.valid_until == 3.0


def test_granted_ttl_larger_than_configured_is_not_trusted_further() -> None:
    """etcd rounds TTLs up to whole seconds (and to its minimum); we keep ours."""
    deadline = LeaseDeadline(ttl=2.5, safety_margin=0.5)
    deadline.renewed(sent_at=0.0, granted_ttl=3)
    assert deadline.valid_until == 2.0


def test_zero_granted_ttl_means_gone_and_extends_nothing() -> None:
    deadline = LeaseDeadline(ttl=10, safety_margin=2)
    assert deadline.renewed(sent_at=0.0, granted_ttl=0) is None
    assert deadline.expired(0.0)
    deadline.renewed(sent_at=1.0)
    deadline.renewed(sent_at=5.0, granted_ttl=0)
    assert deadline.valid_until == 9.0


def test_regular_renewals_keep_it_valid_and_missed_ones_let_it_lapse() -> None:
    ttl, margin = 3.0, 0.6
    deadline = LeaseDeadline(ttl, margin)
    for i in range(10):  # renew every ttl/3
        now = i * ttl / 3
        deadline.renewed(now)
        assert not deadline.expired(now + ttl / 3)
    last = 9 * ttl / 3
    assert not deadline.expired(last + ttl - margin - 1e-9)
    assert deadline.expired(last + ttl - margin)


@pytest.mark.parametrize(("ttl", "margin"), [(0, 0), (-1, 0), (2, 2), (2, 3), (2, -0.1)])
def test_invalid_windows_are_refused(ttl: float, margin: float) -> None:
    with pytest.raises(ValueError):
        LeaseDeadline(ttl, margin)


@pytest.mark.parametrize(
    ("ttl", "margin"), [(1, 0.25), (2, 0.4), (5, 1.0), (10, 2.0), (30, 2.0), (0.5, 0.25)]
)
def test_default_safety_margin(ttl: float, margin: float) -> None:
    assert default_safety_margin(ttl) == pytest.approx(margin)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("http://etcd-1:2379", ("etcd-1", 2379)),
        ("[::1]:2379", ("::1", 2379)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["localhost", ":2379", "host:port"])
def test_parse_endpoint_refuses_garbage(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_endpoint(text)


@pytest.mark.parametrize(("ttl", "etcd_ttl"), [(0.5, 1), (1, 1), (2, 2), (2.5, 3), (10, 10)])
def test_etcd_ttl_is_rounded_up_to_whole_seconds(ttl: float, etcd_ttl: int) -> None:
    election = SingleKey(["127.0.0.1:2379"], "p", "n", ttl=ttl, safety_margin=0.1)
    assert election.etcd_ttl == etcd_ttl
    assert election.ttl == ttl  # the local window keeps the configured float


def test_election_defaults_and_key() -> None:
    election = SingleKey(["127.0.0.1:2379"], "duetime/", "node-1", ttl=10)
    assert election.key == "duetime/leader"
    assert election.safety_margin == 2.0
    assert election.renew_interval == pytest.approx(10 / 3)
    assert not election.is_leader()
    assert election.term_valid_until() is None
    assert election.state == "idle"


def test_renew_interval_leaves_two_attempts_in_a_narrow_window() -> None:
    election = SingleKey(["127.0.0.1:2379"], "p", "n", ttl=10, safety_margin=8)
    assert election.renew_interval == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"endpoints": []},
        {"node_id": ""},
        {"ttl": 0},
        {"safety_margin": 2.0},
        {"safety_margin": -1.0},
        {"call_timeout": 0},
        {"endpoints": ["nohost"]},
    ],
)
def test_election_refuses_bad_configuration(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {
        "endpoints": ["127.0.0.1:2379"],
        "prefix": "p",
        "node_id": "n",
        "ttl": 2.0,
        **kwargs,
    }
    with pytest.raises(ConfigError):
        SingleKey(**args)  # type: ignore[arg-type]
