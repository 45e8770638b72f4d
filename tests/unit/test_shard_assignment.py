"""The shard assignment, pure: the plan, the hysteresis, and convergence in a round model.

The round model stands for etcd: every round all nodes decide on the same view, the
resignations are applied, then each unled shard goes to one of the nodes campaigning
for it (which one is drawn, as etcd's transaction order would decide it).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.leadership.assignment import Assigner, View, plan, rendezvous_order, score, target

STEP = 0.5  # seconds per round: the leadership module's poll interval


class Tick:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def shards_of(k: int) -> tuple[str, ...]:
    return tuple(f"s{i:02d}" for i in range(k))


class Cluster:
    """Nodes with their own ``Assigner`` and one shared leader map."""

    def __init__(self, k: int, seed: int, **assigner: float) -> None:
        self.clock = Tick()
        self.shards = shards_of(k)
        self.leaders: dict[str, str | None] = {}
        self.nodes: dict[str, Assigner] = {}
        self.rng = random.Random(seed)
        self.moves = 0
        self.assigner = assigner

    def join(self, node: str) -> None:
        self.nodes[node] = Assigner(node, self.clock, **self.assigner)  # type: ignore[arg-type]

    def kill(self, node: str) -> None:
        del self.nodes[node]
        for s, holder in self.leaders.items():
            if holder == node:
                self.leaders[s] = None

    def view(self) -> View:
        return View(frozenset(self.nodes), self.shards, dict(self.leaders))

    def round(self) -> bool:
        """One round; True when something changed."""
        self.clock.now += STEP
        view = self.view()
        decisions = {n: a.decide(view) for n, a in self.nodes.items()}
        changed = False
        for node, decision in decisions.items():
            for s in decision.resign:
                assert self.leaders.get(s) == node
                self.leaders[s] = None
                self.moves += 1
                changed = True
        wins = dict.fromkeys(decisions, 0)
        for s in self.shards:
            if self.leaders.get(s) is None:
                candidates = sorted(
                    n for n, d in decisions.items() if s in d.campaign and wins[n] < d.room
                )
                if candidates:
                    winner = self.rng.choice(candidates)
                    self.leaders[s] = winner
                    wins[winner] += 1
                    changed = True
        return changed

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self.nodes, 0)
        for holder in self.leaders.values():
            if holder is not None:
                counts[holder] += 1
        return counts

    def balanced(self) -> bool:
        counts = self.counts()
        return all(self.leaders.get(s) is not None for s in self.shards) and max(
            counts.values()
        ) <= target(len(self.shards), len(self.nodes))

    def run_until_stable(self, max_rounds: int, quiet: int = 6) -> int:
        """Rounds until balanced and nothing changed for ``quiet`` rounds."""
        still = 0
        for i in range(1, max_rounds + 1):
            still = 0 if self.round() else still + 1
            if still >= quiet and self.balanced():
                return i
        raise AssertionError(f"not stable after {max_rounds} rounds: {self.counts()}")


# -- the plan --------------------------------------------------------------------------


def test_target_is_the_ceiling() -> None:
    assert target(64, 16) == 4
    assert target(64, 12) == 6
    assert target(8, 3) == 3
    assert target(3, 8) == 1


def test_score_is_stable_across_processes() -> None:
    # A fixed value: Python's hash() is salted per process, this must not be.
    assert score("s00", "node-a") == score("s00", "node-a")
    assert rendezvous_order("s00", ["b", "a", "c"]) == rendezvous_order("s00", ["c", "b", "a"])


def test_plan_of_an_empty_cluster_spreads_evenly() -> None:
    members = frozenset(f"n{i}" for i in range(5))
    result = plan(View(members, shards_of(12)))
    assert sorted(len(v) for v in result.values()) == [2, 2, 2, 3, 3]
    assert set().union(*result.values()) == set(shards_of(12))


def test_plan_keeps_balanced_leaders_in_place() -> None:
    shards = shards_of(6)
    leaders: dict[str, str | None] = {s: ("a" if i < 3 else "b") for i, s in enumerate(shards)}
    result = plan(View(frozenset({"a", "b"}), shards, leaders))
    assert result == {"a": set(shards[:3]), "b": set(shards[3:])}


def test_plan_moves_only_what_a_newcomer_needs() -> None:
    shards = shards_of(12)
    leaders: dict[str, str | None] = {s: ("a" if i < 6 else "b") for i, s in enumerate(shards)}
    result = plan(View(frozenset({"a", "b", "c"}), shards, leaders))
    assert {k: len(v) for k, v in result.items()} == {"a": 4, "b": 4, "c": 4}
    assert result["a"] <= set(shards[:6]) and result["b"] <= set(shards[6:])


def test_plan_leaves_a_non_members_shard_alone() -> None:
    shards = shards_of(4)
    leaders: dict[str, str | None] = {"s00": "gone"}
    result = plan(View(frozenset({"a", "b"}), shards, leaders))
    assert "s00" not in set().union(*result.values())


# -- decisions and hysteresis ------------------------------------------------------------


def test_no_resign_before_the_membership_settles() -> None:
    clock = Tick()
    shards = shards_of(4)
    leaders: dict[str, str | None] = dict.fromkeys(shards, "a")
    a = Assigner("a", clock, settle=1.0)
    assert a.decide(View(frozenset({"a"}), shards, leaders)).resign == frozenset()
    joined = View(frozenset({"a", "b"}), shards, leaders)
    clock.now += 0.5
    first = a.decide(joined)
    assert first.resign == frozenset() and not first.settled
    clock.now += 1.0
    later = a.decide(joined)
    assert later.settled and len(later.resign) == 2


def test_a_young_node_waits_before_grabbing_unled_shards() -> None:
    clock = Tick()
    shards = shards_of(4)
    a = Assigner("a", clock, settle=1.0, grace=1.0)
    view = View(frozenset({"a"}), shards, {})
    assert a.decide(view).campaign == ()
    clock.now += 1.0
    assert set(a.decide(view).campaign) == set(shards)


def test_a_dead_nodes_shards_are_campaigned_for_at_once() -> None:
    clock = Tick()
    shards = shards_of(4)
    leaders: dict[str, str | None] = {"s00": "a", "s01": "a", "s02": "b", "s03": "b"}
    a = Assigner("a", clock, settle=1.0)
    a.decide(View(frozenset({"a", "b"}), shards, leaders))
    clock.now += 5.0
    a.decide(View(frozenset({"a", "b"}), shards, leaders))
    clock.now += 0.1  # b's lease expired: its member key and shard keys went together
    gone = {"s00": "a", "s01": "a"}
    decision = a.decide(View(frozenset({"a"}), shards, gone))
    assert set(decision.campaign) == {"s02", "s03"} and decision.room == 2


def test_believed_shards_are_not_campaigned_for() -> None:
    clock = Tick()
    a = Assigner("a", clock, settle=0.0, grace=0.0)
    view = View(frozenset({"a"}), shards_of(2), {})
    assert a.decide(view, leading={"s00"}).campaign == ("s01",)


def test_max_resign_limits_one_decision() -> None:
    clock = Tick()
    shards = shards_of(8)
    a = Assigner("a", clock, settle=0.0, max_resign=1)
    decision = a.decide(View(frozenset({"a", "b"}), shards, dict.fromkeys(shards, "a")))
    assert len(decision.resign) == 1


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        Assigner("", Tick())
    with pytest.raises(ValueError):
        Assigner("a", Tick(), settle=-1)
    with pytest.raises(ValueError):
        Assigner("a", Tick(), max_resign=0)


# -- the round model ---------------------------------------------------------------------


def test_cold_start_of_sixteen_converges_without_extra_moves() -> None:
    cluster = Cluster(64, seed=1)
    for i in range(16):
        cluster.join(f"n{i:02d}")
    rounds = cluster.run_until_stable(40)
    assert max(cluster.counts().values()) == 4
    assert cluster.moves == 0, "a simultaneous start needs no handover"
    assert rounds * STEP <= 6


def test_join_moves_exactly_the_newcomers_share() -> None:
    cluster = Cluster(64, seed=2)
    for i in range(12):
        cluster.join(f"n{i:02d}")
    cluster.run_until_stable(40)
    cluster.moves = 0
    for i in range(12, 16):
        cluster.join(f"n{i:02d}")
    rounds = cluster.run_until_stable(40)
    counts = cluster.counts()
    assert max(counts.values()) == 4 and min(counts.values()) == 4
    assert cluster.moves == 16
    assert rounds * STEP <= 6


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(min_value=1, max_value=40),
    r=st.integers(min_value=1, max_value=12),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    initial=st.lists(st.integers(min_value=-1, max_value=11), max_size=40),
    joins=st.integers(min_value=0, max_value=4),
    kills=st.integers(min_value=0, max_value=3),
    max_resign=st.sampled_from([None, 1, 2]),
)
def test_converges_to_at_most_the_ceiling(
    k: int, r: int, seed: int, initial: list[int], joins: int, kills: int,
    max_resign: int | None,
) -> None:  # fmt: skip
    cluster = Cluster(k, seed=seed, max_resign=max_resign)  # type: ignore[arg-type]
    names = [f"n{i:02d}" for i in range(r)]
    for name in names:
        cluster.join(name)
    for s, owner in zip(cluster.shards, initial, strict=False):  # any start, even skewed
        cluster.leaders[s] = names[owner % r] if owner >= 0 else None
    budget = 40 + 2 * k
    cluster.run_until_stable(budget)
    for j in range(joins):
        cluster.join(f"j{j}")
    cluster.run_until_stable(budget)
    victims = sorted(cluster.nodes)[: min(kills, len(cluster.nodes) - 1)]
    for victim in victims:
        cluster.kill(victim)
    cluster.run_until_stable(budget)
    counts = cluster.counts()
    assert max(counts.values()) <= target(k, len(cluster.nodes))
    assert max(counts.values()) - min(counts.values()) <= 1


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1), k=st.integers(1, 30))
def test_every_shard_has_at_most_one_campaign_winner_and_stays_put(seed: int, k: int) -> None:
    cluster = Cluster(k, seed=seed)
    for i in range(5):
        cluster.join(f"n{i}")
    cluster.run_until_stable(60)
    before = dict(cluster.leaders)
    for _ in range(20):  # once stable, nothing moves
        assert not cluster.round()
    assert cluster.leaders == before


class LaggingCluster(Cluster):
    """Each node decides on a view up to ``lag`` rounds old (its own read of etcd) but
    knows its own terms exactly, as ``Elector`` does; resignations and
    campaigns apply to the real state."""

    def __init__(self, k: int, seed: int, lag: int) -> None:
        super().__init__(k, seed)
        self.lag = lag
        self.history: list[View] = []

    def round(self) -> bool:
        self.clock.now += STEP
        self.history.append(self.view())
        decisions = {}
        for n, a in self.nodes.items():
            back = self.rng.randint(0, min(self.lag, len(self.history) - 1))
            seen = self.history[-1 - back]
            own = {s for s, holder in self.leaders.items() if holder == n}  # always current
            decisions[n] = a.decide(seen, leading=own)
        changed = False
        for node, decision in decisions.items():
            for s in decision.resign:
                if self.leaders.get(s) == node:  # a stale view may name a shard already gone
                    self.leaders[s] = None
                    self.moves += 1
                    changed = True
        wins = dict.fromkeys(decisions, 0)
        for s in self.shards:
            if self.leaders.get(s) is None:
                candidates = sorted(
                    n for n, d in decisions.items() if s in d.campaign and wins[n] < d.room
                )
                if candidates:
                    winner = self.rng.choice(candidates)
                    self.leaders[s] = winner
                    wins[winner] += 1
                    changed = True
        return changed


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(min_value=1, max_value=40),
    r=st.integers(min_value=1, max_value=10),
    joins=st.integers(min_value=0, max_value=3),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    lag=st.integers(min_value=1, max_value=3),
)
def test_converges_even_when_nodes_read_stale_views(
    k: int, r: int, joins: int, seed: int, lag: int
) -> None:
    cluster = LaggingCluster(k, seed, lag)
    for i in range(r):
        cluster.join(f"n{i:02d}")
    cluster.run_until_stable(60 + 4 * k, quiet=2 * lag + 4)
    for j in range(joins):
        cluster.join(f"j{j}")
    cluster.run_until_stable(60 + 4 * k, quiet=2 * lag + 4)
    counts = cluster.counts()
    assert max(counts.values()) <= target(k, len(cluster.nodes))
