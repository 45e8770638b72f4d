"""``duetime bench storm --share-transaction``: the storm's handler in a task that opted
into transaction groups, to measure what one transaction per attempt costs a storm."""

from __future__ import annotations

import bench.tasks  # noqa: F401  (registers the benchmark tasks)
from bench.storm import StormParams
from scheduler.cli import build_parser
from workers import default_registry


def test_the_flag_selects_the_shared_task_and_defaults_to_its_own_transactions() -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", "storm", "--share-transaction"]).share_transaction
    assert parser.parse_args(["bench", "storm"]).share_transaction is None
    assert StormParams().share_transaction is False
    shared, own = default_registry.get("bench.record_shared"), default_registry.get("bench.record")
    assert shared is not None and shared.share_transaction
    assert own is not None and not own.share_transaction
