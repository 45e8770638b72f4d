"""Shards in ``Settings`` (``DUETIME_SHARDS``, TOML ``[shards]``), the shard in the job
message, and the producer's routing rule (``shard_for_key``): all pure."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from scheduler.config import Settings, load_settings
from scheduler.errors import ConfigError
from scheduler.messages import JobMessage, MalformedMessage, decode, encode_job
from scheduler.shards.router import shard_for_key

A = "postgresql://duetime:hunter2@db1.internal:5432/duetime_a"
B = "postgresql://db2.internal/duetime_b"


def _error(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(**kwargs)  # type: ignore[arg-type]
    return str(info.value)


# -- settings -----------------------------------------------------------------------


def test_unset_is_one_shard_main_at_the_database_url() -> None:
    s = load_settings(env={"DUETIME_DATABASE_URL": "postgresql://h/x"})
    assert s.shards is None
    assert s.shard_urls == {"main": "postgresql://h/x"}
    assert Settings().shard_urls == {"main": Settings().database_url}
    # an empty variable is "unset", like the other optional settings
    assert load_settings(env={"DUETIME_SHARDS": " "}).shards is None


def test_env_pairs_keep_their_order_and_urls() -> None:
    s = load_settings(env={"DUETIME_SHARDS": f"b={B}, a={A}"})
    assert list(s.shard_urls) == ["b", "a"]
    assert s.shard_urls == {"b": B, "a": A}


def test_toml_table_at_top_level_and_beside_a_duetime_table(tmp_path: Path) -> None:
    top = tmp_path / "top.toml"
    top.write_text(f'lease_ttl = 4\n[shards]\na = "{A}"\nb = "{B}"\n')
    assert load_settings(config_file=top, env={}).shard_urls == {"a": A, "b": B}
    nested = tmp_path / "nested.toml"
    nested.write_text(f'[duetime]\nlease_ttl = 4\n[shards]\nz = "{B}"\n')
    s = load_settings(config_file=nested, env={})
    assert s.lease_ttl == 4 and s.shard_urls == {"z": B}


def test_env_overrides_the_toml_table(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text(f'[shards]\na = "{A}"\n')
    s = load_settings(config_file=path, env={"DUETIME_SHARDS": f"b={B}"})
    assert s.shard_urls == {"b": B}


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (f"Main={A}", "must match [a-z0-9_-]{1,32}"),
        (f"{'x' * 33}={A}", "must match"),
        (f"a={A},a={B}", "appears twice"),
        ("a=mysql://u:hunter2@h/x", "scheme must be postgresql or postgres"),
        ("just-a-name", "is not name=postgresql-url"),
    ],
)
def test_bad_values_fail_at_load_naming_the_variable(value: str, why: str) -> None:
    message = _error(env={"DUETIME_SHARDS": value})
    assert message.startswith("invalid configuration: DUETIME_SHARDS=")
    assert why in message
    assert "hunter2" not in message


def test_bad_toml_table_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text('[shards]\nBAD = "postgresql://h/x"\n')
    message = _error(config_file=path, env={})
    assert f"{path}: shards" in message and "'BAD'" in message


def test_passwords_never_show_in_repr_or_redacted() -> None:
    s = load_settings(env={"DUETIME_SHARDS": f"a={A},b={B}"})
    assert "hunter2" not in repr(s)
    assert s.redacted()["shards"] == {"a": A.replace("hunter2", "***"), "b": B}
    assert "hunter2" not in json.dumps(s.redacted())


# -- the message ---------------------------------------------------------------------

DUE = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)


def test_message_carries_its_shard_both_ways() -> None:
    msg = JobMessage(job_id=7, due_at=DUE, attempt=2, epoch=5, task="t", shard="eu-1")
    body = json.loads(msg.encode())
    assert body["shard"] == "eu-1"
    assert decode(msg.encode()) == msg


def test_a_body_without_shard_is_main() -> None:
    old = json.dumps({"job_id": 7, "due_at": DUE.isoformat(), "attempt": 1, "epoch": 3})
    assert decode(old.encode()).shard == "main"
    assert JobMessage(job_id=7, due_at=DUE, attempt=1, epoch=3).shard == "main"


@pytest.mark.parametrize("shard", ["", "Main", "a/b", "x" * 33, 3, None, ["a"], "a\x00"])
def test_a_bad_shard_name_is_malformed(shard: object) -> None:
    body = {"job_id": 7, "due_at": DUE.isoformat(), "attempt": 1, "epoch": 3, "shard": shard}
    with pytest.raises(MalformedMessage, match="shard"):
        decode(json.dumps(body).encode())


def test_the_encoder_carries_the_shard() -> None:
    message = JobMessage(job_id=9, due_at=DUE, attempt=1, epoch=4, task="t")
    assert decode(encode_job(message)[0]).shard == "main"
    assert decode(encode_job(replace(message, shard="b"))[0]).shard == "b"


# -- routing rule --------------------------------------------------------------------


def test_key_routing_is_pinned_and_ignores_configuration_order() -> None:
    """BLAKE2b-64 mod K over sorted names: these values must never change, or keyed jobs
    of a running cluster would move to other shards."""
    names = ["a", "b", "c"]
    pinned = {key: shard_for_key(key, names) for key in ("order:1", "order:2", "user:42", "")}
    assert pinned == PINNED
    for key, shard in pinned.items():
        assert shard_for_key(key, ["c", "a", "b"]) == shard
        assert shard_for_key(key, tuple(reversed(names))) == shard


PINNED = {"order:1": "a", "order:2": "b", "user:42": "c", "": "a"}


def test_key_routing_spreads_keys_and_one_shard_takes_all() -> None:
    counts = {"a": 0, "b": 0, "c": 0}
    for i in range(3000):
        counts[shard_for_key(f"key-{i}", counts)] += 1
    assert all(800 < n < 1200 for n in counts.values()), counts
    assert {shard_for_key(f"k{i}", ["main"]) for i in range(50)} == {"main"}
    with pytest.raises(ValueError, match="no shards"):
        shard_for_key("k", [])
