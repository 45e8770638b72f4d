"""Insert a whole workflow in one transaction, read it back, cancel it (DESIGN §16;
``scheduler.workflow`` builds the rows, ``workflows.sql`` holds the statements).

``insert_workflow`` runs on a connection the caller holds in a transaction (asyncpg);
``JobStore.enqueue_workflow`` opens one, ``duetime.enqueue_workflow`` does the same
through a synchronous driver (``scheduler.store.sync_jobs``). One statement per layer
(a 10,000-member fan-in is two statements), each row's ``depends_on`` holding the ids
the earlier layers returned.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from scheduler.errors import InvalidInput
from scheduler.sql import load
from scheduler.store.rows import Job
from scheduler.workflow import Workflow, WorkflowJobs

Q = load("workflows")


def layer_document(
    wf: Workflow, layer: Sequence[int], ids: Sequence[int | None], now: datetime
) -> str:
    """The JSON text of one layer's rows; ``InvalidInput`` for a payload or meta that is
    not JSON (before anything is written)."""
    try:
        return json.dumps(wf.rows(layer, ids, now), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"a workflow step's payload or meta is not JSON: {exc}") from exc


def place(
    wf: Workflow,
    layer: Sequence[int],
    records: Sequence[Any],
    ids: list[int | None],
    jobs: list[Job | None],
    decode: Callable[[Any], Job],
) -> None:
    """Match one layer's returned rows (sorted by id: the insert order) to its steps."""
    if len(records) != len(layer):
        raise InvalidInput(f"a workflow layer inserted {len(records)} rows of {len(layer)}")
    for i, record in zip(layer, sorted(records, key=lambda r: r["id"]), strict=True):
        job = decode(record)
        ids[i] = job.id
        jobs[i] = job


async def insert_workflow(conn: Any, wf: Workflow, now: datetime) -> WorkflowJobs:
    """Insert ``wf`` through ``conn`` (asyncpg, in the caller's transaction)."""
    if not len(wf):
        raise InvalidInput("an empty workflow: add a step first")
    workflow_id = int(await conn.fetchval(Q["next_workflow_id"]))
    ids: list[int | None] = [None] * len(wf)
    jobs: list[Job | None] = [None] * len(wf)
    for layer in wf.layers():
        records = await conn.fetch(
            Q["insert_layer"], layer_document(wf, layer, ids, now), workflow_id
        )
        place(wf, layer, records, ids, jobs, Job.from_record)
    return WorkflowJobs(workflow_id, [j for j in jobs if j is not None])
