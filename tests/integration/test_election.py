"""Leader election against a real etcd (a private server per module, TTL 2 s).

Covers the promises in DESIGN §1.3/§1.4 and §4: one winner per key incarnation,
epoch = create_revision and strictly increasing, failover within TTL + 1 s after a
crash (no resign), immediate handover on resign, a leader that loses etcd (stopped
server, blackholed network) stepping down within the TTL and *before* anyone else can
win, and prefixes isolating clusters. Timings are printed as ``MEASURE name=value``
lines (run with ``-s`` to see them) and attached to the test report as properties.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import aetcd
import pytest
import pytest_asyncio

from scheduler.config.shards import DEFAULT_SHARD
from scheduler.errors import LeadershipLost, ServiceUnavailable
from scheduler.leadership.elector import Elector, ShardEvent
from tests.support.election import SingleKey, Term
from tests.support.etcd import PrivateEtcd, free_port
from tests.support.proxy import FaultProxy
from tests.support.wait import wait_for

TTL = 2.0
CALL_TIMEOUT = 1.0
pytestmark = pytest.mark.timeout(60)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def etcd() -> AsyncIterator[PrivateEtcd]:
    async with PrivateEtcd() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"duetime-test/{uuid.uuid4().hex[:10]}"


class Owned:
    """Elections and tasks created by one test, closed and cancelled at teardown."""

    def __init__(self) -> None:
        self.elections: list[SingleKey] = []
        self.tasks: list[asyncio.Task[Any]] = []

    def task(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(e.close() for e in self.elections), return_exceptions=True)


@pytest_asyncio.fixture
async def owned() -> AsyncIterator[Owned]:
    things = Owned()
    try:
        yield things
    finally:
        await things.close()


@pytest.fixture
def make(etcd: PrivateEtcd, prefix: str, owned: Owned) -> Iterator[Callable[..., SingleKey]]:
    def factory(node_id: str, **kwargs: Any) -> SingleKey:
        kwargs.setdefault("endpoints", etcd.endpoints)
        kwargs.setdefault("prefix", prefix)
        election = SingleKey(node_id=node_id, ttl=TTL, call_timeout=CALL_TIMEOUT, **kwargs)
        owned.elections.append(election)
        return election

    yield factory


def measure(record_property: Callable[[str, object], None], name: str, seconds: float) -> None:
    print(f"\nMEASURE {name}={seconds:.3f}s")
    record_property(name, round(seconds, 3))


async def raw_get(endpoint: str, key: str) -> Any:
    host, _, port = endpoint.rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
        return await client.get(key.encode())


async def campaign(election: SingleKey, timeout: float = 5.0) -> Term:
    return await asyncio.wait_for(election.campaign(), timeout)


async def test_single_candidate_wins_with_epoch_equal_to_create_revision(
    make: Callable[..., SingleKey], etcd: PrivateEtcd
) -> None:
    election = make("node-a")
    assert not election.is_leader()
    assert await election.current_leader() is None

    term = await campaign(election)

    kv = await raw_get(etcd.endpoint, election.key)
    assert kv.value == b"node-a"  # contract: the key's value is the node id
    assert kv.create_revision == term.epoch
    assert kv.lease == term.lease_id
    assert election.is_leader()
    valid_until = election.term_valid_until()
    assert valid_until is not None
    assert 0 < valid_until - time.monotonic() <= TTL - election.safety_margin
    assert await election.current_leader() == ("node-a", term.epoch)

    await election.resign(term)
    assert not election.is_leader()
    assert election.term_valid_until() is None
    assert await election.current_leader() is None


async def test_hold_renews_the_trust_window(make: Callable[..., SingleKey], owned: Owned) -> None:
    election = make("node-a")
    term = await campaign(election)
    first = election.term_valid_until()
    assert first is not None
    owned.task(election.hold(term), "hold")
    # Three renewals (every TTL/3) push the window well past the first one.
    await wait_for(
        lambda: (election.term_valid_until() or 0) > first + TTL,
        timeout=TTL * 2,
        message="trust window extended by renewals",
    )
    assert election.is_leader()


async def test_crash_without_resign_fails_over_within_ttl_plus_one(
    make: Callable[..., SingleKey],
    owned: Owned,
    record_property: Callable[[str, object], None],
) -> None:
    a, b = make("node-a"), make("node-b")
    tasks = {owned.task(a.campaign(), "a"): a, owned.task(b.campaign(), "b"): b}
    done, pending = await asyncio.wait(tasks, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, "exactly one candidate wins"
    (won_task,), (lost_task,) = done, pending
    winner, loser = tasks[won_task], tasks[lost_task]
    first: Term = won_task.result()
    assert await loser.current_leader() == (winner.node_id, first.epoch)

    hold = owned.task(winner.hold(first), "hold")
    initial = winner.term_valid_until() or 0
    await wait_for(
        lambda: (winner.term_valid_until() or 0) > initial + 1, timeout=5, message="renewals"
    )
    assert not lost_task.done(), "the standby must not win while the leader renews"

    hold.cancel()  # the leader "crashes": no more renewals, no resign
    crashed_at = time.monotonic()
    second: Term = await asyncio.wait_for(lost_task, TTL + 3)
    failover = time.monotonic() - crashed_at

    measure(record_property, "failover_after_crash", failover)
    assert failover < TTL + 1.0
    assert second.epoch > first.epoch
    assert not winner.is_leader(), "the old leader stopped trusting before the new one won"
    assert await winner.current_leader() == (loser.node_id, second.epoch)


async def test_resign_hands_over_immediately(
    make: Callable[..., SingleKey],
    owned: Owned,
    record_property: Callable[[str, object], None],
) -> None:
    a, b = make("node-a"), make("node-b")
    first = await campaign(a)
    standby = owned.task(b.campaign(), "b")
    owned.task(a.hold(first), "hold")
    await wait_for(lambda: b.state == "follower", timeout=2, message="standby watching")

    resigned_at = time.monotonic()
    await asyncio.wait_for(a.resign(first), 2 * CALL_TIMEOUT + 0.5)
    second: Term = await asyncio.wait_for(standby, 3)
    handover = time.monotonic() - resigned_at

    measure(record_property, "handover_after_resign", handover)
    assert handover < 1.0
    assert second.epoch > first.epoch
    assert not a.is_leader()


async def test_epochs_strictly_increase_across_terms(make: Callable[..., SingleKey]) -> None:
    nodes = [make(f"node-{i}") for i in range(4)]
    epochs = []
    for _round in range(2):
        for node in nodes:
            term = await campaign(node)
            epochs.append(term.epoch)
            await node.resign(term)
    assert epochs == sorted(set(epochs)), epochs


async def test_restart_with_same_node_id_waits_for_the_old_lease(
    make: Callable[..., SingleKey],
    etcd: PrivateEtcd,
    record_property: Callable[[str, object], None],
) -> None:
    old = make("node-a")
    first = await campaign(old)
    await old.close()  # the process dies: key and lease stay behind until the TTL

    restarted = make("node-a")
    started = time.monotonic()
    second = await campaign(restarted, timeout=TTL + 3)
    waited = time.monotonic() - started

    measure(record_property, "same_node_restart_wait", waited)
    assert second.epoch > first.epoch, "a new incarnation, never the old key adopted"
    assert second.lease_id != first.lease_id
    assert waited > TTL / 2  # it did wait for expiry of a lease granted moments before
    assert waited < TTL + 1.0
    kv = await raw_get(etcd.endpoint, restarted.key)
    assert (kv.create_revision, kv.lease) == (second.epoch, second.lease_id)


async def test_hold_notices_the_key_deleted_by_an_operator(
    make: Callable[..., SingleKey], owned: Owned, etcd: PrivateEtcd
) -> None:
    election = make("node-a")
    term = await campaign(election)
    hold = owned.task(election.hold(term), "hold")
    host, _, port = etcd.endpoint.rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
        await client.delete(election.key.encode())
    with pytest.raises(LeadershipLost) as lost:
        await asyncio.wait_for(hold, TTL)
    assert lost.value.reason == "key_deleted"
    assert not election.is_leader()


async def test_connection_cut_is_survived_within_the_window(
    make: Callable[..., SingleKey], owned: Owned, etcd: PrivateEtcd
) -> None:
    async with FaultProxy.for_endpoint(etcd.endpoint) as proxy:
        election = make("node-a", endpoints=[proxy.endpoint])
        term = await campaign(election)
        hold = owned.task(election.hold(term), "hold")
        await wait_for(lambda: proxy.connections > 0, timeout=2, message="a proxied connection")
        assert proxy.cut() >= 1
        cut_at = time.monotonic()
        await wait_for(
            lambda: (election.term_valid_until() or 0) > cut_at + TTL / 2,
            timeout=TTL,
            message="a renewal over a new connection",
        )
        assert not hold.done()
        assert election.is_leader()
        hold.cancel()


async def test_different_prefixes_do_not_interfere(
    make: Callable[..., SingleKey], owned: Owned
) -> None:
    base = f"duetime-test/{uuid.uuid4().hex[:10]}"
    a = make("node-a", prefix=f"{base}/one")
    b = make("node-b", prefix=f"{base}/two")
    term_a = await campaign(a)
    term_b = await campaign(b)  # immediately: another prefix, another key
    assert a.key != b.key
    hold_b = owned.task(b.hold(term_b), "hold-b")
    await a.resign(term_a)
    assert await a.current_leader() is None
    assert await b.current_leader() == ("node-b", term_b.epoch)
    assert not hold_b.done() and b.is_leader()


async def test_dead_endpoint_is_skipped(make: Callable[..., SingleKey], etcd: PrivateEtcd) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    election = make("node-a", endpoints=[dead, etcd.endpoint])
    term = await campaign(election, timeout=5)
    assert await election.current_leader() == ("node-a", term.epoch)


async def test_current_leader_raises_service_unavailable_when_etcd_is_down(
    make: Callable[..., SingleKey],
) -> None:
    election = make("node-a", endpoints=[f"127.0.0.1:{free_port()}"])
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable):
        await election.current_leader()
    assert time.monotonic() - started < CALL_TIMEOUT + 0.5


async def test_blackholed_leader_steps_down_before_the_standby_wins(
    make: Callable[..., SingleKey],
    owned: Owned,
    etcd: PrivateEtcd,
    record_property: Callable[[str, object], None],
) -> None:
    async with FaultProxy.for_endpoint(etcd.endpoint) as proxy:
        leader = make("node-a", endpoints=[proxy.endpoint])
        standby = make("node-b")
        first = await campaign(leader)
        hold = owned.task(leader.hold(first), "hold")
        waiting = owned.task(standby.campaign(), "standby")
        lost_at: list[float] = []
        hold.add_done_callback(lambda _: lost_at.append(time.monotonic()))

        proxy.blackhole(True)  # a partition: nothing fails fast, calls just time out
        partitioned_at = time.monotonic()
        with pytest.raises(LeadershipLost) as lost:
            await asyncio.wait_for(asyncio.shield(hold), TTL + 1)
        second: Term = await asyncio.wait_for(waiting, TTL + 3)
        won_at = time.monotonic()

        measure(record_property, "blackhole_notice", lost_at[0] - partitioned_at)
        measure(record_property, "blackhole_failover", won_at - partitioned_at)
        assert lost.value.reason == "lease_unconfirmed"
        assert lost_at[0] - partitioned_at < TTL
        assert lost_at[0] < won_at, "the old leader must step down before a new one is elected"
        assert won_at - partitioned_at < TTL + 1.0
        assert second.epoch > first.epoch

        proxy.blackhole(False)  # healed: the old leader now sees the new one
        info = await wait_for(leader.current_leader, timeout=5, message="leader visible again")
        assert info == ("node-b", second.epoch)


async def test_leader_steps_down_when_etcd_stops_and_wins_again_after(
    owned: Owned, record_property: Callable[[str, object], None]
) -> None:
    async with PrivateEtcd() as server:
        election = SingleKey(
            server.endpoints, "duetime-test/outage", "node-a", ttl=TTL, call_timeout=CALL_TIMEOUT
        )
        owned.elections.append(election)
        first = await campaign(election)
        hold = owned.task(election.hold(first), "hold")

        stopped_at = time.monotonic()
        await server.stop()
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(hold, TTL + 1)
        notice = time.monotonic() - stopped_at
        measure(record_property, "etcd_stop_notice", notice)
        assert notice < TTL
        assert not election.is_leader()

        # While etcd is down a campaign keeps retrying (with back-off) instead of failing.
        again = owned.task(election.campaign(), "campaign-again")
        await server.start()
        assert not again.done()
        restarted_at = time.monotonic()
        second: Term = await asyncio.wait_for(again, 15)
        measure(record_property, "win_after_etcd_restart", time.monotonic() - restarted_at)
        assert second.epoch > first.epoch
        assert election.is_leader()
        await election.resign(second)


async def test_frozen_etcd_leader_steps_down_and_standby_wins_after_thaw(
    owned: Owned, prefix: str, record_property: Callable[[str, object], None]
) -> None:
    async with PrivateEtcd() as server:
        a, b = (
            SingleKey(server.endpoints, prefix, node, ttl=TTL, call_timeout=CALL_TIMEOUT)
            for node in ("node-a", "node-b")
        )
        owned.elections += [a, b]
        first = await campaign(a)
        hold = owned.task(a.hold(first), "hold")
        standby = owned.task(b.campaign(), "standby")
        await wait_for(lambda: b.state == "follower", timeout=2, message="standby watching")

        server.pause()  # SIGSTOP: sockets stay open, nothing answers
        frozen_at = time.monotonic()
        try:
            with pytest.raises(LeadershipLost):
                await asyncio.wait_for(hold, TTL + 1)
            notice = time.monotonic() - frozen_at
            assert not standby.done()
        finally:
            server.resume()
        thawed_at = time.monotonic()
        second: Term = await asyncio.wait_for(standby, 10)

        measure(record_property, "etcd_freeze_notice", notice)
        measure(record_property, "win_after_thaw", time.monotonic() - thawed_at)
        assert notice < TTL
        assert second.epoch > first.epoch
        assert await b.current_leader() == ("node-b", second.epoch)


@pytest.mark.parametrize("left", [0.2, 0.5])
async def test_lease_granted_late_is_confirmed_before_campaigning(
    etcd: PrivateEtcd, prefix: str, left: float
) -> None:
    """A grant held by a partition arrives with its window nearly spent (the window counts
    from when the request was sent). The node must not win on that remnant: it would lose
    the shard within milliseconds and leadership would change hands again after every
    outage. It confirms the lease first, wins once and keeps leading."""
    gained: list[tuple[int, float]] = []
    elector: Elector | None = None

    async def handler(event: ShardEvent) -> None:
        if event.kind == "gained":
            assert elector is not None
            until = elector.valid_until()
            gained.append((event.term.epoch, (until or 0.0) - time.monotonic()))

    async with FaultProxy.for_endpoint(etcd.endpoint) as proxy:
        proxy.blackhole(True)  # the first grant is held, as during a partition
        elector = Elector(
            [proxy.endpoint], prefix, "node-a", [DEFAULT_SHARD], ttl=TTL,
            call_timeout=3.0, handler=handler,
        )  # fmt: skip
        await elector.start()
        try:
            # Heal when the held grant has ``left`` of its 1.6 s window left.
            await asyncio.sleep(TTL - elector.safety_margin - left)
            proxy.heal()
            await wait_for(lambda: gained, timeout=5, message="gained after the heal")
            await asyncio.sleep(TTL * 1.5)  # observation window: it must still lead
            assert len(gained) == 1, gained
            epoch, trust = gained[0]
            fresh = TTL - elector.safety_margin - 0.3
            assert trust >= fresh, f"won with {trust:.3f}s of trust left"
            assert elector.is_leader(DEFAULT_SHARD)
            term = elector.term(DEFAULT_SHARD)
            assert term is not None and term.epoch == epoch
        finally:
            await elector.stop()


async def test_lease_given_up_during_an_outage_is_revoked_once_etcd_is_back(
    prefix: str,
) -> None:
    """A restarted etcd renews the leases it kept, so the key of a node that lost its
    lease during the outage would block the shard for a whole TTL after etcd is back.
    The node revokes that lease as soon as etcd answers: it leads again well before the
    old lease could have expired."""
    ttl = 6.0
    async with PrivateEtcd() as server:
        gained: list[float] = []

        async def handler(event: ShardEvent) -> None:
            if event.kind == "gained":
                gained.append(time.monotonic())

        elector = Elector(
            server.endpoints, prefix, "node-a", [DEFAULT_SHARD], ttl=ttl,
            call_timeout=CALL_TIMEOUT, handler=handler,
        )  # fmt: skip
        await elector.start()
        try:
            await wait_for(lambda: gained, timeout=10, message="first term")
            first = elector.term(DEFAULT_SHARD)
            assert first is not None
            await server.stop()
            await wait_for(
                lambda: not elector.is_leader(DEFAULT_SHARD), timeout=ttl + 1,
                message="term lost while etcd is down",
            )  # fmt: skip
            await server.start()
            back = time.monotonic()
            await wait_for(lambda: len(gained) == 2, timeout=ttl * 3, message="leads again")
            took = gained[1] - back
            print(f"\nMEASURE lead_again_after_etcd_restart={took:.3f}s")
            assert took < ttl - 1.0, f"waited {took:.3f}s: the old lease was left to expire"
            term = elector.term(DEFAULT_SHARD)
            assert term is not None and term.epoch > first.epoch
            assert term.lease_id != first.lease_id
        finally:
            await elector.stop()
