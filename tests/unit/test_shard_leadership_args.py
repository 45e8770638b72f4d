"""``Elector`` refuses bad arguments at construction (no etcd needed), and
``stop()`` before ``start()`` is safe."""

from __future__ import annotations

import pytest

from scheduler.config.shards import member_key, shard_key
from scheduler.errors import ConfigError
from scheduler.leadership.elector import Elector

EP = ["127.0.0.1:2379"]


def test_keys_are_the_contract() -> None:
    assert shard_key("duetime/", "eu") == "duetime/shards/eu/leader"
    assert member_key("duetime", "node-1") == "duetime/members/node-1"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(endpoints=[]), "etcd endpoint"),
        (dict(node_id=""), "node_id"),
        (dict(node_id="a/b"), "node_id"),
        (dict(shards=[]), "shards must be"),
        (dict(shards=["a", "a"]), "shards must be"),
        (dict(shards=["Bad"]), "shards must be"),
        (dict(ttl=0), "lease ttl"),
        (dict(ttl=2, safety_margin=2), "safety margin"),
        (dict(poll_interval=0), "poll_interval"),
        (dict(ttl=2, poll_interval=3), "poll_interval"),
        (dict(call_timeout=0), "call_timeout"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    args: dict = dict(endpoints=EP, prefix="p", node_id="n1", shards=["a"]) | kwargs
    with pytest.raises(ConfigError, match=message):
        Elector(
            args.pop("endpoints"), args.pop("prefix"), args.pop("node_id"), args.pop("shards"),
            **args,
        )  # fmt: skip


async def test_stop_before_start_is_safe() -> None:
    leadership = Elector(EP, "p", "n1", ["a"], ttl=2)
    await leadership.stop()
    await leadership.stop()
    assert leadership.leading() == {} and not leadership.is_leader("a")
    assert [e async for e in leadership.events()] == []
