"""``duetime workflows show ID [--cancel]``: the jobs of one workflow (migration 0025),
each with its state and what it waits for, oldest first; ``cancel`` cancels every
unfinished one (``JobStore.cancel_workflow``). Errors are one line (``scheduler.cli``)."""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.cli._util import add_shard_option, emit, job_id, opened, print_json, print_table, say
from scheduler.cli.jobs import _who
from scheduler.config import Settings
from scheduler.errors import InvalidInput
from scheduler.store import JobStore
from scheduler.store.rows import Job

COLUMNS = ("id", "task", "status", "attempt", "waits_for", "finished_at", "last_error")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    wf = sub.add_parser("workflows", help="inspect and cancel workflows (jobs that wait for jobs)")
    wsub = wf.add_subparsers(dest="workflows_command", metavar="ACTION", required=True)
    for name, helptext, func in (
        ("show", "show the jobs of a workflow, their states and edges", run_show),
        ("cancel", "cancel every unfinished job of a workflow", run_cancel),
    ):
        parser = wsub.add_parser(name, parents=[common], help=helptext)
        parser.add_argument("workflow_id", type=job_id, metavar="ID")
        add_shard_option(parser)
        parser.add_argument("--json", action="store_true")
        parser.set_defaults(func=func)


def row(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "task": job.task,
        "status": job.status,
        "attempt": job.attempt,
        "waits_for": ",".join(str(d) for d in job.depends_on or ()) or "-",
        "finished_at": job.finished_at,
        "last_error": job.last_error,
    }


async def run_show(args: argparse.Namespace, settings: Settings) -> int:
    async with opened(settings, JobStore, shard=args.shard) as store:
        jobs = await store.workflow(args.workflow_id)
    if not jobs:
        raise InvalidInput(f"no workflow {args.workflow_id} (no job carries that workflow_id)")
    if args.json:
        print_json([j.to_dict() for j in jobs])
        return 0
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j.status] = counts.get(j.status, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    say(f"workflow {args.workflow_id}: {len(jobs)} job(s): {summary}")
    print_table([row(j) for j in jobs], COLUMNS)
    return 0


async def run_cancel(args: argparse.Namespace, settings: Settings) -> int:
    async with opened(settings, JobStore, shard=args.shard) as store:
        if not await store.workflow(args.workflow_id, limit=1):
            raise InvalidInput(f"no workflow {args.workflow_id} (no job carries that workflow_id)")
        n = await store.cancel_workflow(args.workflow_id, by=_who())
    return emit(
        args, {"cancelled": n}, f"cancelled {n} unfinished job(s) of workflow {args.workflow_id}"
    )
