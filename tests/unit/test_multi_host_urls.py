"""libpq multi-host database URLs (``h1:5432,h2:5432``) are accepted wherever a database
URL is configured: the form every duetime process is given for a shard whose PostgreSQL
is a Patroni pair (``target_session_attrs=read-write`` picks the writable host)."""

from __future__ import annotations

import pytest

from scheduler.config import load_settings
from scheduler.config.shards import host_list_problem, parse_shards_env
from scheduler.errors import ConfigError

PAIR = (
    "postgresql://duetime:pw@10.0.1.11:5432,10.0.1.12:5432/shard_a?target_session_attrs=read-write"
)


def test_database_url_with_two_hosts() -> None:
    settings = load_settings(env={"DUETIME_DATABASE_URL": PAIR})
    assert settings.database_url == PAIR


def test_shards_with_host_lists_split_on_pairs_only() -> None:
    other = "postgresql://u@[::1]:5433,db-b2/shard_b?target_session_attrs=read-write"
    shards = parse_shards_env(f"a={PAIR},b={other}")
    assert [(s.name, s.url) for s in shards] == [("a", PAIR), ("b", other)]


@pytest.mark.parametrize(
    ("netloc", "problem"),
    [
        ("h1:5432,h2:70000", "invalid port in its host list"),
        ("h1,,h2", "invalid host ''"),
        ("h1:x,h2", "invalid host 'h1:x'"),
        ("h 1,h2", "invalid host 'h 1'"),
        ("h:99999", "invalid port"),
    ],
)
def test_bad_host_lists(netloc: str, problem: str) -> None:
    found = host_list_problem(netloc)
    assert found is not None and problem in found


@pytest.mark.parametrize("netloc", ["h", "u:p@h:5432", "u@h1:1,[::1]:2,h3", ""])
def test_good_host_lists(netloc: str) -> None:
    assert host_list_problem(netloc) is None


def test_a_bad_port_in_a_host_list_is_refused_in_both_places() -> None:
    bad = "postgresql://u:secret@h1:5432,h2:99999/db"
    with pytest.raises(ConfigError, match="invalid port in its host list") as info:
        load_settings(env={"DUETIME_DATABASE_URL": bad})
    assert "secret" not in str(info.value)
    with pytest.raises(ConfigError, match="invalid port in its host list") as info:
        parse_shards_env(f"a={bad}")
    assert "secret" not in str(info.value)
