"""The workflow builder (pure; scheduler/workflow.py): shapes, layers, refusals."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from scheduler.errors import InvalidInput
from scheduler.workflow import StepRef, Workflow, chain, chord, group, step

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def edges(wf: Workflow) -> list[tuple[int, ...]]:
    return [tuple(r.index for r in wf.after_of(StepRef(i))) for i in range(len(wf))]


def test_chain_group_chord_shapes() -> None:
    assert edges(chain(step("a"), step("b"), step("c"))) == [(), (0,), (1,)]
    assert edges(group(step("a"), step("b"))) == [(), ()]
    fan = chord([step("m", {"i": i}) for i in range(3)], step("cb"))
    assert edges(fan) == [(), (), (), (0, 1, 2)]
    # a chain through a group: every member waits for the first step, the last for all
    mixed = chain(step("a"), group(step("b"), step("c")), step("d"))
    assert edges(mixed) == [(), (0,), (0,), (1, 2)]
    assert [list(layer) for layer in mixed.layers()] == [[0], [1, 2], [3]]


def test_rows_carry_ids_options_and_the_failure_mode() -> None:
    wf = Workflow()
    a = wf.add("a", {"x": 1}, queue="q1", delay=timedelta(seconds=5), tags=["t"])
    wf.add("b", after=[a, a], on_dependency_failure="run", priority=3)
    first, second = wf.layers()
    (row_a,) = wf.rows(first, [None, None], NOW)
    assert row_a["due_at"] == (NOW + timedelta(seconds=5)).isoformat()
    assert (row_a["queue"], row_a["tags"], row_a["depends_on"]) == ("q1", ["t"], None)
    (row_b,) = wf.rows(second, [41, None], NOW)
    assert row_b["depends_on"] == [41]
    assert (row_b["on_dependency_failure"], row_b["priority"]) == ("run", 3)


@pytest.mark.parametrize(
    "build",
    [
        lambda: step(""),
        lambda: step("a", [1]),  # type: ignore[arg-type]
        lambda: step("a", on_dependency_failure="maybe"),  # type: ignore[arg-type]
        lambda: step("a", colour="red"),
        lambda: step("a", due_at=NOW, delay=1),
        lambda: Workflow().add("a", after=[StepRef(0)]),
        lambda: chain("a"),  # type: ignore[arg-type]
    ],
)
def test_refusals(build: object) -> None:
    with pytest.raises(InvalidInput):
        build()  # type: ignore[operator]


def test_a_step_can_only_wait_for_earlier_steps_so_no_cycle_exists() -> None:
    wf = Workflow()
    a = wf.add("a")
    b = wf.add("b", after=[a])
    with pytest.raises(InvalidInput):
        wf.add("c", after=[StepRef(b.index + 1)])  # itself / a later step
