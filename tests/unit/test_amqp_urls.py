"""``amqp_url`` as a RabbitMQ cluster: several comma-separated URLs, each validated at
config load like a single one, never a password shown, split back into the node list
``scheduler.broker.ClusterConnection`` walks (DESIGN §8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.broker import ClusterConnection, amqp_urls, connect
from scheduler.config import load_settings, redact_url
from scheduler.errors import ConfigError, InvalidInput, ServiceUnavailable

NODES = (
    "amqp://svc:pw-1@mq1.internal:5672/duetime",
    "amqp://svc:pw-2@mq2.internal:5672/duetime",
    "amqps://svc:pw-3@mq3.internal:5671/duetime?cafile=/etc/duetime/ca.pem",
)


def _error(value: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(env={"DUETIME_AMQP_URL": value})
    return str(info.value)


def test_one_url_is_kept_as_given() -> None:
    s = load_settings(env={"DUETIME_AMQP_URL": "amqp://guest:guest@127.0.0.1:5672/v"})
    assert s.amqp_url == "amqp://guest:guest@127.0.0.1:5672/v"
    assert amqp_urls(s.amqp_url) == ("amqp://guest:guest@127.0.0.1:5672/v",)


def test_several_urls_in_order_spaces_dropped() -> None:
    s = load_settings(env={"DUETIME_AMQP_URL": " , ".join(NODES)})
    assert s.amqp_url == ",".join(NODES)
    assert amqp_urls(s.amqp_url) == NODES


def test_toml_list_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "duetime.toml"
    path.write_text("amqp_url = [" + ", ".join(f'"{u}"' for u in NODES) + "]\n")
    s = load_settings(env={}, config_file=path)
    assert amqp_urls(s.amqp_url) == NODES


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("amqp://a:1@h1/,http://a:2@h2/", "URL 2 of 2 scheme must be one of amqp, amqps"),
        ("amqp://a:1@h1/,", "URL 2 of 2 must be a non-empty URL string"),
        (",amqp://a:1@h1/", "URL 1 of 2 must be a non-empty URL string"),
        ("amqp://a:1@h1/,,amqp://a:1@h2/", "URL 2 of 3 must be a non-empty URL string"),
        ("amqp://a:1@h1/,amqp://a:2@h2:99999/", "URL 2 of 2 has an invalid port"),
        ("amqp://a:1@h1/,amqp:///vhost", "URL 2 of 2 has no host"),
        ("amqp://a:1@h1:5672/,amqp://a:1@h1:5672/", "lists amqp://a:***@h1:5672/ twice"),
        ("mq1.internal:5672", "URL scheme must be one of amqp, amqps"),
    ],
)
def test_bad_lists_fail_at_load_naming_the_url(value: str, expected: str) -> None:
    message = _error(value)
    assert "DUETIME_AMQP_URL=" in message and expected in message, message
    for secret in (":1@", ":2@"):
        assert secret not in message, message


def test_every_password_of_a_list_is_redacted() -> None:
    s = load_settings(env={"DUETIME_AMQP_URL": ",".join(NODES)})
    shown = s.redacted()["amqp_url"]
    assert shown == (
        "amqp://svc:***@mq1.internal:5672/duetime,"
        "amqp://svc:***@mq2.internal:5672/duetime,"
        "amqps://svc:***@mq3.internal:5671/duetime?cafile=/etc/duetime/ca.pem"
    )
    assert "pw-" not in repr(s)


def test_redact_leaves_a_libpq_multi_host_url_whole() -> None:
    url = "postgresql://app:pw@db1:5432,db2:5432/duetime?target_session_attrs=read-write"
    assert redact_url(url) == (
        "postgresql://app:***@db1:5432,db2:5432/duetime?target_session_attrs=read-write"
    )


def test_broker_refuses_an_empty_entry_given_directly() -> None:
    with pytest.raises(InvalidInput, match="empty URL"):
        amqp_urls("amqp://a:secret@h1/,")


async def test_each_node_gets_the_options_of_its_own_url() -> None:
    connection = ClusterConnection(NODES, reconnect_interval=1.0)
    try:
        (first, first_options), (_, second_options), (third, third_options) = connection.nodes
        assert str(connection.url) == NODES[0] == str(first)
        assert connection.reconnect_interval == 1.0
        assert "reconnect_interval" not in second_options
        assert third.scheme == "amqps" and third.port == 5671
        assert third.query["cafile"] == "/etc/duetime/ca.pem"
        assert third_options.keys() == first_options.keys() == second_options.keys()
    finally:
        await connection.close()


async def test_no_node_reachable_names_every_node_without_passwords() -> None:
    # ports nothing listens on: each node refuses at once
    urls = "amqp://u:hidden@127.0.0.1:9/,amqp://u:hidden@127.0.0.1:7/"
    with pytest.raises(ServiceUnavailable) as info:
        await connect(urls, timeout=2)
    message = str(info.value)
    assert message.startswith("cannot connect to RabbitMQ at any node: ")
    assert "127.0.0.1:9" in message and "127.0.0.1:7" in message
    assert "hidden" not in message
    assert info.value.transient
