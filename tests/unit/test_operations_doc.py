"""docs/operations.md cannot drift from the code it documents: every metric, every
leader step-down reason, every `duetime status` finding code, the runbooks the issue
asks for."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

import scheduler.metrics as duetime_metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _exposed_names() -> list[str]:
    names = []
    for value in vars(duetime_metrics).values():
        if isinstance(value, MetricWrapperBase):
            names.append(value._name + ("_total" if value._type == "counter" else ""))
    return names


def test_every_metric_is_documented_in_the_table() -> None:
    text = DOC.read_text()
    rows = set(re.findall(r"^\| `(duetime_[a-z_]+)` \|", text, flags=re.MULTILINE))
    names = set(_exposed_names())
    assert names, "no metrics found in scheduler/metrics.py"
    assert not names - rows, f"undocumented metrics: {sorted(names - rows)}"
    assert not rows - names, f"documented metrics that do not exist: {sorted(rows - names)}"


def test_step_down_reasons_and_status_codes_are_documented() -> None:
    from scheduler.leadership.policy import STEP_DOWN_REASONS

    text = DOC.read_text()
    for reason in STEP_DOWN_REASONS:
        assert f"`{reason}`" in text, f"step-down reason {reason} not explained"
    for code in (
        "no_leader", "leader_stale", "backlog_too_old", "database_unreachable",
        "etcd_unreachable", "epoch_mismatch", "node_mismatch",
    ):  # fmt: skip
        assert f"`{code}`" in text, code
    status_source = (Path(__file__).resolve().parents[2] / "scheduler" / "status.py").read_text()
    emitted = set(re.findall(r'Finding\(\s*"([a-z_]+)"', status_source))
    assert emitted and all(f"`{c}`" in text for c in emitted), emitted


def test_runbooks_exist() -> None:
    text = DOC.read_text()
    for title in (
        "No leader", "Backlog growing", "Jobs going dead", "etcd down",
        "RabbitMQ down", "PostgreSQL down",
    ):  # fmt: skip
        assert f"### {title}" in text, title
