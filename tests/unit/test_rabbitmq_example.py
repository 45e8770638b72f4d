"""deploy/rabbitmq: the three node files are one configuration with three addresses.

Their "cluster" section is booted by tests/chaos/test_rabbit_cluster.py (RabbitMQ
rejects unknown keys there); this checks what no single node can: that the files agree
with each other and with the README's table.
"""

from __future__ import annotations

import re
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "rabbitmq"
NODES = (1, 2, 3)


def _settings(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = (part.strip() for part in line.partition("="))
            assert sep, f"not key = value: {line!r}"
            assert key not in out, f"{key} set twice"
            out[key] = value
    return out


def _sections(n: int) -> tuple[dict[str, str], dict[str, str]]:
    text = (EXAMPLE / f"rabbitmq-{n}.conf").read_text()
    node, cluster = text.split("## -- the cluster", 1)
    node = node.split("## -- this node", 1)[1]
    # each section starts after the rest of its header line
    return _settings(node.split("\n", 1)[1]), _settings(cluster.split("\n", 1)[1])


def test_cluster_sections_are_identical_and_list_every_node() -> None:
    clusters = [_sections(n)[1] for n in NODES]
    assert clusters[0] == clusters[1] == clusters[2]
    peers = {k: v for k, v in clusters[0].items() if k.startswith("cluster_formation.classic")}
    assert sorted(peers.values()) == [f"rabbit@mq{n}" for n in NODES]
    assert clusters[0]["cluster_partition_handling"] == "pause_minority"


def test_each_node_uses_only_its_own_address_and_certificate() -> None:
    readme = (EXAMPLE / "README.md").read_text()
    for n in NODES:
        node, _ = _sections(n)
        address = f"10.0.0.2{n}"
        assert f"| `rabbitmq-{n}.conf` | mq{n}.internal | {address} | `rabbit@mq{n}` |" in readme
        addresses = set(re.findall(r"10\.0\.0\.\d+", " ".join(node.values())))
        assert addresses == {address}, (n, addresses)
        assert node["listeners.tcp"] == "none"  # TLS only
        assert node["ssl_options.certfile"].endswith(f"/mq{n}.pem")
        assert node["ssl_options.keyfile"].endswith(f"/mq{n}.key")
        assert node["ssl_options.fail_if_no_peer_cert"] == "true"


def test_enabled_plugins_is_an_erlang_list() -> None:
    text = (EXAMPLE / "enabled_plugins").read_text().strip()
    assert re.fullmatch(r"\[[a-z_]+(,[a-z_]+)*\]\.", text), text
