"""Configuration: precedence (defaults < TOML < environment < flags), one error line per
bad value naming its source, and no password ever shown (DESIGN §7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.config import (
    FIELDS,
    MIN_RETENTION_DAYS,
    Settings,
    env_name,
    load_settings,
    redact_url,
)
from scheduler.duties.maintainer import MaintainerConfig
from scheduler.errors import ConfigError
from scheduler.log import scrub


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "duetime.toml"
    path.write_text(text)
    return path


def _error(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(**kwargs)  # type: ignore[arg-type]
    return str(info.value)


# -- precedence -------------------------------------------------------------------------


def test_defaults_point_at_loopback() -> None:
    s = load_settings(env={})
    assert s.database_url == "postgresql://postgres@127.0.0.1:5432/duetime"
    assert s.amqp_url.startswith("amqp://") and "127.0.0.1:5672" in s.amqp_url
    assert s.etcd_endpoints == ("127.0.0.1:2379",)
    assert s.etcd_prefix == "duetime"
    assert s.lease_ttl == 10.0
    assert s.metrics_port is None


def test_toml_then_env_then_flags(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        'lease_ttl = 5\netcd_prefix = "from-toml"\nnode_id = "toml-node"\nclaim_batch_size = 7\n',
    )
    env = {"DUETIME_LEASE_TTL": "6.5", "DUETIME_ETCD_PREFIX": "from-env"}
    only_toml = load_settings(config_file=path, env={})
    assert (only_toml.lease_ttl, only_toml.etcd_prefix, only_toml.node_id) == (
        5.0,
        "from-toml",
        "toml-node",
    )
    with_env = load_settings(config_file=path, env=env)
    assert (with_env.lease_ttl, with_env.etcd_prefix, with_env.node_id) == (
        6.5,
        "from-env",
        "toml-node",
    )
    with_flags = load_settings(config_file=path, env=env, overrides={"lease_ttl": "8"})
    assert (with_flags.lease_ttl, with_flags.etcd_prefix) == (8.0, "from-env")
    assert with_flags.claim_batch_size == 7  # untouched by env and flags: the file wins
    # A flag left unset (None) does not override anything.
    assert load_settings(config_file=path, env=env, overrides={"lease_ttl": None}).lease_ttl == 6.5


def test_config_file_from_environment_and_duetime_table(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[duetime]\nlease_ttl = 3.5\netcd_endpoints = ["a:1", "b:2"]\n')
    s = load_settings(env={"DUETIME_CONFIG": str(path)})
    assert s.lease_ttl == 3.5
    assert s.etcd_endpoints == ("a:1", "b:2")


def test_env_values_are_parsed() -> None:
    s = load_settings(
        env={
            "DUETIME_ETCD_ENDPOINTS": "http://10.0.0.1:2379, 10.0.0.2:2379",
            "DUETIME_LEASE_TTL": "2.5",
            "DUETIME_METRICS_PORT": "9100",
            "DUETIME_NODE_ID": "n1",
            "DUETIME_LOG_LEVEL": "DEBUG",
        }
    )
    assert s.etcd_endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert s.lease_ttl == 2.5
    assert s.metrics_port == 9100
    assert s.node_id == "n1"
    assert s.log_level == "debug"


def test_test_harness_variables_are_not_config() -> None:
    """DUETIME_TEST_* belongs to the test harness, not to a duetime process."""
    s = load_settings(env={"DUETIME_TEST_DATABASE_URL": "whatever"})
    assert s.database_url == Settings().database_url


def test_every_field_has_an_env_name_and_help() -> None:
    for name, spec in FIELDS.items():
        assert env_name(name) == "DUETIME_" + name.upper()
        assert spec.help


# -- errors: one line per bad value, naming the source ----------------------------------


def test_bad_url_is_one_line_naming_variable() -> None:
    message = _error(env={"DUETIME_DATABASE_URL": "mysql://u:hunter2@db/x"})
    assert message.count("\n") == 0
    assert message.startswith("invalid configuration: DUETIME_DATABASE_URL=")
    assert "scheme must be one of postgresql, postgres" in message
    assert "hunter2" not in message


@pytest.mark.parametrize(
    ("value", "why"),
    [("not a url", "scheme"), ("postgresql://", "has no host"), ("postgresql://h:99999/x", "port")],
)
def test_bad_database_urls(value: str, why: str) -> None:
    assert why in _error(env={"DUETIME_DATABASE_URL": value})


def test_negative_ttl() -> None:
    message = _error(env={"DUETIME_LEASE_TTL": "-1"})
    assert message == (
        "invalid configuration: DUETIME_LEASE_TTL=-1: lease_ttl must be >= 1.0 (got '-1')"
    )


def test_non_numeric_ttl_from_flag() -> None:
    message = _error(env={}, overrides={"lease_ttl": "soon"})
    assert message.startswith("invalid configuration: --lease-ttl=soon: lease_ttl must be a float")


def test_unknown_toml_key_suggests_the_right_one(tmp_path: Path) -> None:
    path = _toml(tmp_path, "lease_tl = 5\n")
    message = _error(config_file=path, env={})
    assert message == (
        f"invalid configuration: unknown key 'lease_tl' in {path}; did you mean 'lease_ttl'?"
    )


def test_unknown_env_variable_suggests_the_variable() -> None:
    message = _error(env={"DUETIME_LEASE_TL": "5"})
    assert "unknown environment variable DUETIME_LEASE_TL; did you mean DUETIME_LEASE_TTL?" in (
        message
    )


def test_every_bad_value_is_reported_on_its_own_line(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'lease_tl = 5\nmetrics_port = 70000\netcd_endpoints = "nohostport"\n')
    message = _error(
        config_file=path, env={"DUETIME_LEASE_TTL": "0", "DUETIME_AMQP_URL": "http://x/"}
    )
    lines = message.splitlines()
    assert lines[0] == "invalid configuration:"
    body = lines[1:]
    assert len(body) == 5, message
    assert any("lease_tl" in line and "did you mean 'lease_ttl'" in line for line in body)
    assert any(line.strip().startswith(f"{path}: metrics_port=70000") for line in body)
    assert any("etcd_endpoints" in line and "not host:port" in line for line in body)
    assert any(line.strip().startswith("DUETIME_LEASE_TTL=0") for line in body)
    assert any(line.strip().startswith("DUETIME_AMQP_URL=http://x/") for line in body)


def test_missing_and_invalid_toml_files(tmp_path: Path) -> None:
    assert "does not exist" in _error(config_file=tmp_path / "nope.toml", env={})
    bad = _toml(tmp_path, "lease_ttl = = 5\n")
    assert "is not valid TOML" in _error(config_file=bad, env={})


def test_safety_margin_must_be_below_ttl() -> None:
    message = _error(env={"DUETIME_LEASE_TTL": "2", "DUETIME_LEASE_SAFETY_MARGIN": "3"})
    assert message == (
        "invalid configuration: lease_safety_margin 3.0 must be smaller than lease_ttl 2.0"
    )


def test_unknown_override_key() -> None:
    assert "did you mean 'lease_ttl'" in _error(env={}, overrides={"lease_tll": 3})


def test_secret_values_are_not_echoed_in_errors() -> None:
    # etcd_password is parsed as optional text (never fails), so use a URL carrying one.
    message = _error(env={"DUETIME_AMQP_URL": "amqp://user:s3cret@:bad/"})
    assert "s3cret" not in message


# -- redaction ----------------------------------------------------------------------------


def test_redacted_and_repr_hide_passwords() -> None:
    s = load_settings(
        env={
            "DUETIME_DATABASE_URL": "postgresql://app:pg-s3cret@db.internal:5432/jobs",
            "DUETIME_AMQP_URL": "amqp://svc:mq-s3cret@[::1]:5672/prod",
            "DUETIME_ETCD_PASSWORD": "etcd-s3cret",
        }
    )
    red = s.redacted()
    assert red["database_url"] == "postgresql://app:***@db.internal:5432/jobs"
    assert red["amqp_url"] == "amqp://svc:***@[::1]:5672/prod"
    assert red["etcd_password"] == "***"
    assert red["etcd_endpoints"] == ["127.0.0.1:2379"]
    for text in (repr(s), str(s), str(red)):
        for secret in ("pg-s3cret", "mq-s3cret", "etcd-s3cret"):
            assert secret not in text
    # The real values stay usable by the program.
    assert s.database_url.endswith("app:pg-s3cret@db.internal:5432/jobs")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:p@h:5432/d", "postgresql://u:***@h:5432/d"),
        ("postgresql://:p@h/d", "postgresql://:***@h/d"),
        ("postgresql://u@h/d", "postgresql://u@h/d"),
        ("postgresql://h/d?sslmode=require", "postgresql://h/d?sslmode=require"),
        ("amqp://u:p@[::1]:5672/v", "amqp://u:***@[::1]:5672/v"),
        ("amqp://u:p@h:notaport/v", "amqp://u:***@h:notaport/v"),  # must not raise
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_scrub_redacts_urls_inside_text() -> None:
    text = (
        "cannot connect to postgresql://app:pg-s3cret@db:5432/x; "
        "broker amqps://svc:mq:s3cret@mq/vh failed"
    )
    out = scrub(text)
    assert "pg-s3cret" not in out and "mq:s3cret" not in out and "s3cret" not in out
    assert "postgresql://app:***@db:5432/x" in out
    assert "amqps://svc:***@mq/vh" in out
    assert scrub("no secrets at http://host/path") == "no secrets at http://host/path"


def test_max_republishes_default_and_validation() -> None:
    assert load_settings(env={}).max_republishes == 10
    assert load_settings(env={"DUETIME_MAX_REPUBLISHES": "3"}).max_republishes == 3
    message = _error(env={"DUETIME_MAX_REPUBLISHES": "0"})
    assert "DUETIME_MAX_REPUBLISHES" in message and ">= 1" in message


@pytest.mark.parametrize("value", ["0", "0.5", "-1", "nan", "inf"])
def test_a_retention_under_a_day_or_not_finite_is_refused_at_load(value: str) -> None:
    """The retention is the idempotency window: 0 let the maintainer empty the ledger at
    once, so a duplicate of a completed key ran again."""
    message = _error(env={"DUETIME_RETENTION_DAYS": value})
    assert message.count("\n") == 0
    assert message.startswith(f"invalid configuration: DUETIME_RETENTION_DAYS={value}: ")
    bound = "a finite number" if value in ("nan", "inf") else f">= {MIN_RETENTION_DAYS}"
    assert f"retention_days must be {bound}" in message
    assert load_settings(env={"DUETIME_RETENTION_DAYS": "1"}).retention_days == 1.0
    if value != "inf":  # a config built by hand has the same floor
        with pytest.raises(ValueError, match="retention_days must be >= 1"):
            MaintainerConfig(retention_days=float(value))


def test_an_integer_setting_given_infinity_in_toml_is_one_line(tmp_path: Path) -> None:
    """TOML's ``inf`` is a float; int(inf) raised OverflowError through the loader."""
    path = tmp_path / "duetime.toml"
    path.write_text("metrics_port = inf\n")
    message = _error(config_file=path, env={})
    assert message.count("\n") == 0
    assert "metrics_port" in message and "must be a int" in message


def test_queues_from_env_and_toml(tmp_path: Path) -> None:
    """DUETIME_QUEUES / TOML ``queues``: the queues ``duetime migrate`` declares."""
    assert load_settings(env={}).queues == ()
    env = {"DUETIME_QUEUES": "emails, reports.eu,emails"}
    assert load_settings(env=env).queues == ("emails", "reports.eu")
    path = tmp_path / "duetime.toml"
    path.write_text('queues = ["a", "b-c"]\n')
    assert load_settings(config_file=path, env={}).queues == ("a", "b-c")
    error = _error(env={"DUETIME_QUEUES": "ok,bad name"})
    assert "DUETIME_QUEUES" in error and "'bad name' is invalid" in error
