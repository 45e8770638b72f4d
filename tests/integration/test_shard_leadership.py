"""``Elector`` in one process against the real etcd (TTL 2 s, own prefix).

What the owner relies on: the keys and values (contract), epochs as create revisions,
a resignation telling the owner before the key goes, ``stop()`` freeing every key at
once, a key deleted behind a leader's back reported lost, keys we must not adopt, and
a frozen etcd (a private server) ending every term inside the trust window.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import aetcd
import pytest
import pytest_asyncio

from scheduler.config.shards import member_key, shard_key
from scheduler.leadership.elector import Elector, ShardEvent
from tests.support.etcd import PrivateEtcd
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(60)
TTL = 2.0
SHARDS = ("a", "b", "c", "d")


@pytest.fixture
def prefix() -> str:
    return f"duetime-test/shardlead-{uuid.uuid4().hex[:10]}"


@pytest_asyncio.fixture
async def etcd(etcd_endpoints: str, prefix: str) -> AsyncIterator[aetcd.Client]:
    host, _, port = etcd_endpoints.split(",")[0].rpartition(":")
    client = aetcd.Client(host=host, port=int(port), timeout=2.0)
    try:
        yield client
    finally:
        await client.delete_prefix(f"{prefix}/".encode())
        await client.close()


class Node:
    """One ``Elector`` whose handler records events in order."""

    def __init__(self, endpoints: str, prefix: str, node_id: str, etcd: aetcd.Client) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.key_at_loss: dict[str, bool] = {}
        self._etcd = etcd
        self.prefix = prefix
        self.leadership = Elector(
            endpoints.split(","), prefix, node_id, SHARDS, ttl=TTL, call_timeout=1.0,
            poll_interval=0.3, handler=self._record,
        )  # fmt: skip

    async def _record(self, event: ShardEvent) -> None:
        self.events.append((event.kind, event.shard, event.reason))
        if event.kind == "lost":  # is the key still there while the owner stops duties?
            kv = await self._etcd.get(shard_key(self.prefix, event.shard).encode())
            self.key_at_loss[event.shard] = kv is not None

    def led(self) -> set[str]:
        return set(self.leadership.leading())


async def holders(etcd: aetcd.Client, prefix: str) -> dict[str, str]:
    out = {}
    for shard in SHARDS:
        kv = await etcd.get(shard_key(prefix, shard).encode())
        if kv is not None:
            out[shard] = bytes(kv.value).decode()
    return out


async def test_two_nodes_split_the_shards_and_stop_frees_them_at_once(
    etcd_endpoints: str, prefix: str, etcd: aetcd.Client
) -> None:
    one = Node(etcd_endpoints, prefix, "n1", etcd)
    two = Node(etcd_endpoints, prefix, "n2", etcd)
    await one.leadership.start()
    await two.leadership.start()
    try:
        await wait_for(lambda: len(one.led()) == 2 and len(two.led()) == 2, 15,
                       message="2 shards each")  # fmt: skip
        assert one.led().isdisjoint(two.led())
        keys = await holders(etcd, prefix)
        assert keys == {s: "n1" for s in one.led()} | {s: "n2" for s in two.led()}
        member = await etcd.get(member_key(prefix, "n1").encode())
        assert member is not None and bytes(member.value) == b"n1"
        for shard, term in one.leadership.leading().items():
            kv = await etcd.get(shard_key(prefix, shard).encode())
            assert kv is not None and kv.create_revision == term.epoch
    finally:
        await two.leadership.stop()
    assert not two.led()
    assert {kind for kind, _, _ in two.events} == {"gained", "lost"}
    assert all(reason == "stopped" for kind, _, reason in two.events if kind == "lost")
    # stop() revoked the lease: the keys went with it, and n1 takes every shard at once.
    assert await etcd.get(member_key(prefix, "n2").encode()) is None
    try:
        await wait_for(lambda: one.led() == set(SHARDS), TTL, message="n1 leads all")
    finally:
        await one.leadership.stop()


async def test_a_join_takes_its_share_by_handover_and_the_owner_is_told_first(
    etcd_endpoints: str, prefix: str, etcd: aetcd.Client
) -> None:
    one = Node(etcd_endpoints, prefix, "n1", etcd)
    await one.leadership.start()
    two = Node(etcd_endpoints, prefix, "n2", etcd)
    try:
        await wait_for(lambda: one.led() == set(SHARDS), 10, message="n1 leads all")
        epochs = {s: t.epoch for s, t in one.leadership.leading().items()}
        await two.leadership.start()
        try:
            await wait_for(lambda: len(two.led()) == 2 and len(one.led()) == 2, 10,
                           message="handover to the newcomer")  # fmt: skip
        except AssertionError as exc:
            views = (one.leadership.view, two.leadership.view)
            events = (one.events, two.events)
            raise AssertionError(f"{exc}; views {views}; events {events}") from None
        handed = [shard for kind, shard, reason in one.events if reason == "rebalance"]
        assert sorted(handed) == sorted(two.led())
        assert all(one.key_at_loss[s] for s in handed), "owner told before the key went"
        for shard, term in two.leadership.leading().items():
            assert term.epoch > epochs[shard], "a new incarnation, a larger epoch"
    finally:
        await two.leadership.stop()
        await one.leadership.stop()


async def test_keys_deleted_behind_the_nodes_back_are_noticed(
    etcd_endpoints: str, prefix: str, etcd: aetcd.Client
) -> None:
    one = Node(etcd_endpoints, prefix, "n1", etcd)
    await one.leadership.start()
    try:
        await wait_for(lambda: one.led() == set(SHARDS), 10, message="n1 leads all")
        await etcd.delete(shard_key(prefix, "a").encode())
        await wait_for(lambda: ("lost", "a", "key_deleted") in one.events, 5,
                       message="loss reported")  # fmt: skip
        await wait_for(lambda: "a" in one.led(), 5, message="campaigned for again")
        await etcd.delete(member_key(prefix, "n1").encode())

        async def member_back() -> bool:
            return await etcd.get(member_key(prefix, "n1").encode()) is not None

        await wait_for(member_back, 5, message="member key restored")
    finally:
        await one.leadership.stop()


async def test_a_key_of_an_old_process_with_our_node_id_is_not_adopted(
    etcd_endpoints: str, prefix: str, etcd: aetcd.Client
) -> None:
    old = await etcd.lease(int(TTL))
    await etcd.put(shard_key(prefix, "a").encode(), b"n1", lease=old.id)
    one = Node(etcd_endpoints, prefix, "n1", etcd)
    await one.leadership.start()
    try:
        await wait_for(lambda: one.led() == {"b", "c", "d"}, 10, message="the other three")
        assert "a" not in one.led()
        # The old lease is never refreshed: once it expires, "a" is won anew.
        await wait_for(lambda: "a" in one.led(), TTL + 3, message="a after expiry")
        term = one.leadership.term("a")
        assert term is not None and term.lease_id != old.id
    finally:
        await one.leadership.stop()


async def test_events_iterator_ends_on_stop(
    etcd_endpoints: str, prefix: str, etcd: aetcd.Client
) -> None:
    leadership = Elector(etcd_endpoints.split(","), prefix, "n1", ("a",), ttl=TTL, call_timeout=1.0)
    seen: list[tuple[str, str]] = []

    async def consume() -> None:
        async for event in leadership.events():
            seen.append((event.kind, event.shard))

    consumer = asyncio.create_task(consume())
    await leadership.start()
    try:
        await wait_for(lambda: seen == [("gained", "a")], 10, message="gained a")
    finally:
        await leadership.stop()
        await leadership.stop()  # twice is safe
    await asyncio.wait_for(consumer, 2)
    assert seen == [("gained", "a"), ("lost", "a")]


async def test_a_frozen_etcd_ends_every_term_inside_the_window_then_it_recovers() -> None:
    async with PrivateEtcd() as server:
        endpoint = server.endpoint
        host, _, port = endpoint.rpartition(":")
        etcd = aetcd.Client(host=host, port=int(port), timeout=2.0)
        prefix = f"duetime-test/shardfreeze-{uuid.uuid4().hex[:10]}"
        one = Node(endpoint, prefix, "n1", etcd)
        await one.leadership.start()
        try:
            await wait_for(lambda: one.led() == set(SHARDS), 10, message="n1 leads all")
            epochs = {s: t.epoch for s, t in one.leadership.leading().items()}
            server.pause()
            frozen_at = asyncio.get_running_loop().time()
            await wait_for(lambda: not one.led(), TTL + 1, message="every term ended")
            took = asyncio.get_running_loop().time() - frozen_at
            print(f"MEASURE shards_lost_after_freeze={took:.3f}")
            assert took <= TTL, "trust ends before etcd could expire the lease"
            await wait_for(
                lambda: {shard for kind, shard, reason in one.events
                         if kind == "lost" and reason == "lease_unconfirmed"} == set(SHARDS),
                0.5, message="the owner told of every loss at once",
            )  # fmt: skip
            server.resume()
            await wait_for(lambda: one.led() == set(SHARDS), 15, message="led again")
            for shard, term in one.leadership.leading().items():
                assert term.epoch > epochs[shard]
        finally:
            server.resume()
            await one.leadership.stop()
            await etcd.close()
