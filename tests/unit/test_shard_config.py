"""Shard configuration: ``DUETIME_SHARDS`` pairs, the TOML table, and the default."""

from __future__ import annotations

import tomllib

import pytest

from scheduler.config.shards import (
    Shard,
    parse_shards_env,
    parse_shards_table,
    shards_from,
)
from scheduler.errors import ConfigError

URL = "postgresql://postgres@127.0.0.1:5432/duetime"


def test_unset_is_one_main_shard_at_the_database_url() -> None:
    assert shards_from(URL) == (Shard("main", URL),)
    assert shards_from(URL, env_value="  ") == (Shard("main", URL),)


def test_env_pairs_in_order() -> None:
    value = "a=postgresql://h1/db1, b_2=postgres://u@h2:5433/db2"
    assert parse_shards_env(value) == (
        Shard("a", "postgresql://h1/db1"),
        Shard("b_2", "postgres://u@h2:5433/db2"),
    )


def test_a_comma_inside_a_query_string_stays_in_its_url() -> None:
    first = "postgresql://h/db?options=-c%20a=1,b=2"
    shards = parse_shards_env(f"one={first},two=postgresql://h/db2")
    assert [s.url for s in shards] == [first, "postgresql://h/db2"]


def test_env_wins_over_the_table() -> None:
    shards = shards_from(URL, "x=postgresql://h/x", {"y": "postgresql://h/y"})
    assert [s.name for s in shards] == ["x"]


def test_toml_table() -> None:
    table = tomllib.loads('[shards]\neu = "postgresql://h/eu"\nus = "postgresql://h/us"\n')
    assert [s.name for s in shards_from(URL, None, table["shards"])] == ["eu", "us"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("A=postgresql://h/db", "must match [a-z0-9_-]{1,32}"),
        ("x" * 33 + "=postgresql://h/db", "must match"),
        ("a=postgresql://h/1,a=postgresql://h/2", "appears twice"),
        ("a=mysql://h/db", "scheme must be postgresql or postgres"),
        ("a=postgresql:///db", "has no host"),
        ("a=postgresql://h:99999/db", "not a valid URL"),
        ("a=postgresql://h/db,junk", "has a comma outside its query string"),
        ("just-a-name", "is not name=postgresql-url"),
        ("=postgresql://h/db", "shard name ''"),
        (",", "names no shard"),
    ],
)
def test_bad_values_are_refused_clearly(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match="invalid shards") as info:
        parse_shards_env(value)
    assert message in str(info.value)


def test_every_bad_pair_is_listed_and_passwords_are_redacted() -> None:
    with pytest.raises(ConfigError) as info:
        parse_shards_env("A=postgresql://u:secret@h/db,b=mysql://u:hunter2@h/db")
    text = str(info.value)
    assert "'A'" in text and "mysql" in text
    assert "secret" not in text and "hunter2" not in text


def test_bad_tables_are_refused() -> None:
    with pytest.raises(ConfigError, match="must be a table"):
        parse_shards_table(["a"])
    with pytest.raises(ConfigError, match="non-empty postgresql"):
        parse_shards_table({"a": 5})
    with pytest.raises(ConfigError, match="names no shard"):
        parse_shards_table({})


def test_repr_hides_the_password() -> None:
    assert "secret" not in repr(Shard("a", "postgresql://u:secret@h/db"))


@pytest.mark.parametrize("prefix", ["duetime", "duetime/", "/duetime"])
def test_status_reads_the_election_key_the_elector_writes(prefix: str) -> None:
    from scheduler.config.shards import election_key  # what the replica gives the elector
    from scheduler.status import election_key as status_key

    assert status_key(prefix) == election_key(prefix) == f"{prefix.rstrip('/')}/leader"
