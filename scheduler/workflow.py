"""Workflows as data (pure): ``Workflow`` (a small DAG builder) and the Celery-canvas
shapes ``chain``, ``group`` and ``chord`` over ``step``s (DESIGN §16; docs/api.md
"Workflows" and "Coming from Celery canvas").

A workflow is a list of steps, each naming the earlier steps it waits for: a step can
only wait for a step added before it, so a workflow is acyclic by construction (the same
argument as the database's: ``depends_on`` takes ids of rows that already exist,
migration 0025). ``JobStore.enqueue_workflow`` / ``duetime.enqueue_workflow`` insert it
in one transaction, one statement per layer (the steps whose dependencies are all in
earlier layers), under a new ``workflow_id``; the rows' ``depends_on`` then hold the
real job ids. A workflow lives in one database, so in one shard: the store it is
enqueued through is one shard's (``ShardRouter.store(key)`` picks it by a key).

No I/O here: this module only builds the rows (``layers``), so it is tested without a
database (tests/unit/test_workflow.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from scheduler.errors import InvalidInput

OnDependencyFailure = Literal["cancel", "run"]
#: the step options a workflow passes to its rows (the rest take the column defaults)
STEP_OPTIONS = (
    "queue",
    "due_at",
    "delay",
    "max_attempts",
    "priority",
    "idempotency_key",
    "limit_key",
    "tags",
    "meta",
    "timeout_s",
)
#: the most steps one workflow inserts (a fan-in of 100,000 is the column's CHECK)
MAX_STEPS = 100_000


@dataclass(frozen=True, slots=True)
class Step:
    """One job of a workflow, not yet placed: ``step("resize", {"id": 1}, queue="img")``."""

    task: str
    payload: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    on_dependency_failure: OnDependencyFailure = "cancel"


def step(
    task: str,
    payload: dict[str, Any] | None = None,
    *,
    on_dependency_failure: OnDependencyFailure = "cancel",
    **options: Any,
) -> Step:
    """A step for ``chain``/``group``/``chord`` (Celery's signature, ``task.s(...)``).
    ``options``: ``queue``, ``due_at``, ``delay``, ``max_attempts``, ``priority``,
    ``idempotency_key``, ``limit_key``, ``tags``, ``meta``, ``timeout_s``."""
    if not isinstance(task, str) or not task.strip():
        raise InvalidInput("a workflow step needs a task name")
    if payload is not None and not isinstance(payload, dict):
        raise InvalidInput(f"the payload of step {task!r} must be a dict")
    if on_dependency_failure not in ("cancel", "run"):
        raise InvalidInput(
            f"on_dependency_failure must be 'cancel' or 'run', not {on_dependency_failure!r}"
        )
    unknown = sorted(set(options) - set(STEP_OPTIONS))
    if unknown:
        raise InvalidInput(f"unknown step options {unknown} (known: {', '.join(STEP_OPTIONS)})")
    if "due_at" in options and "delay" in options:
        raise InvalidInput(f"step {task!r}: give due_at or delay, not both")
    return Step(task, dict(payload or {}), dict(options), on_dependency_failure)


@dataclass(frozen=True, slots=True)
class StepRef:
    """A step's place in its workflow (what ``Workflow.add`` returns); index into
    ``WorkflowJobs.jobs``."""

    index: int


@dataclass(frozen=True, slots=True)
class _Node:
    step: Step
    after: tuple[int, ...]


class Workflow:
    """A DAG of steps: ``wf.add(task, payload, after=[a, b])`` returns a ``StepRef``
    for later steps to wait for. Also what ``chain``, ``group`` and ``chord`` return."""

    __slots__ = ("_nodes",)

    def __init__(self) -> None:
        self._nodes: list[_Node] = []

    def add(
        self,
        task: str | Step,
        payload: dict[str, Any] | None = None,
        *,
        after: Iterable[StepRef] = (),
        on_dependency_failure: OnDependencyFailure = "cancel",
        **options: Any,
    ) -> StepRef:
        """Add a step waiting for the steps ``after`` (each added before it)."""
        s = (
            task
            if isinstance(task, Step)
            else step(task, payload, on_dependency_failure=on_dependency_failure, **options)
        )
        deps: list[int] = []
        for ref in after:
            if not isinstance(ref, StepRef) or not 0 <= ref.index < len(self._nodes):
                raise InvalidInput(f"after= takes steps of this workflow added before, not {ref!r}")
            if ref.index not in deps:
                deps.append(ref.index)
        if len(self._nodes) >= MAX_STEPS:
            raise InvalidInput(f"a workflow holds at most {MAX_STEPS} steps")
        self._nodes.append(_Node(s, tuple(deps)))
        return StepRef(len(self._nodes) - 1)

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def steps(self) -> list[Step]:
        return [n.step for n in self._nodes]

    def after_of(self, ref: StepRef) -> tuple[StepRef, ...]:
        """The steps ``ref`` waits for."""
        return tuple(StepRef(i) for i in self._nodes[ref.index].after)

    @property
    def heads(self) -> list[StepRef]:
        """The steps that wait for nothing in this workflow."""
        return [StepRef(i) for i, n in enumerate(self._nodes) if not n.after]

    @property
    def tails(self) -> list[StepRef]:
        """The steps nothing in this workflow waits for (what a chain's next part waits
        for, a chord's callback too)."""
        waited = {d for n in self._nodes for d in n.after}
        return [StepRef(i) for i in range(len(self._nodes)) if i not in waited]

    def include(self, other: Workflow | Step, *, after: Iterable[StepRef] = ()) -> list[StepRef]:
        """Copy ``other`` in; its heads wait for ``after``. Returns its tails, here."""
        if isinstance(other, Step):
            return [self.add(other, after=after)]
        before = list(after)
        offset = len(self._nodes)
        for n in other._nodes:
            extra = before if not n.after else []
            self.add(n.step, after=[*(StepRef(offset + d) for d in n.after), *extra])
        return [StepRef(offset + t.index) for t in other.tails]

    def layers(self) -> Iterator[list[int]]:
        """The steps in insert order: each layer's steps wait only for earlier layers."""
        level: list[int] = []
        for n in self._nodes:
            level.append(1 + max((level[d] for d in n.after), default=-1))
        for depth in range(max(level, default=-1) + 1):
            yield [i for i, lv in enumerate(level) if lv == depth]

    def rows(self, layer: Sequence[int], ids: Sequence[int | None], now: datetime) -> list[dict]:
        """The JSON documents of one layer's rows (``workflows.sql`` ``insert_layer``);
        ``ids[i]``: the job id of step ``i`` once inserted."""
        out: list[dict[str, Any]] = []
        for i in layer:
            n = self._nodes[i]
            o = n.step.options
            due = o.get("due_at")
            if due is None and o.get("delay") is not None:
                delay = o["delay"]
                seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
                due = now + timedelta(seconds=float(seconds))
            if due is not None and (not isinstance(due, datetime) or due.tzinfo is None):
                raise InvalidInput(f"step {n.step.task!r}: due_at must be an aware datetime")
            out.append(
                {
                    "task": n.step.task,
                    "payload": n.step.payload,
                    "queue": o.get("queue"),
                    "due_at": due.isoformat() if due is not None else None,
                    "max_attempts": o.get("max_attempts"),
                    "priority": o.get("priority"),
                    "idempotency_key": o.get("idempotency_key"),
                    "limit_key": o.get("limit_key"),
                    "tags": list(o["tags"]) if o.get("tags") is not None else None,
                    "meta": o.get("meta"),
                    "timeout_s": o.get("timeout_s"),
                    "depends_on": [ids[d] for d in n.after] if n.after else None,
                    "on_dependency_failure": n.step.on_dependency_failure,
                }
            )
        return out


def _as_workflow(item: Workflow | Step) -> Workflow:
    if isinstance(item, Workflow):
        return item
    if isinstance(item, Step):
        wf = Workflow()
        wf.add(item)
        return wf
    raise InvalidInput(
        f"a workflow is made of steps (duetime.workflow.step) and workflows, not {item!r}"
    )


def chain(*items: Workflow | Step) -> Workflow:
    """Each part starts when the previous one's last steps succeeded (Celery ``chain``)."""
    wf = Workflow()
    tails: list[StepRef] = []
    for item in items:
        tails = wf.include(_as_workflow(item), after=tails)
    return wf


def group(*items: Workflow | Step) -> Workflow:
    """Parts that run side by side, waiting for nothing (Celery ``group``)."""
    wf = Workflow()
    for item in items:
        wf.include(_as_workflow(item))
    return wf


def chord(header: Workflow | Step | Iterable[Workflow | Step], callback: Step) -> Workflow:
    """``callback`` starts once every part of ``header`` succeeded (Celery ``chord``): a
    fan-in. Its ``ctx.dependencies`` holds the members' results, in id order."""
    head = header if isinstance(header, Workflow | Step) else group(*header)
    return chain(head, callback)


@dataclass(frozen=True, slots=True)
class WorkflowJobs:
    """What ``enqueue_workflow`` inserted: the ``workflow_id`` and the jobs, in the order
    of the workflow's steps (``jobs[ref.index]``, or ``run[ref]``)."""

    workflow_id: int
    jobs: list[Any]

    def __getitem__(self, ref: StepRef) -> Any:
        return self.jobs[ref.index]

    @property
    def ids(self) -> list[int]:
        return [j.id for j in self.jobs]
