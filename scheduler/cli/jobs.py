"""``duetime jobs add|list|show|cancel|retry``.

``jobs add --unique-key`` says which job holds the key afterwards, which
``JobStore.enqueue`` alone does not tell (it returns the holder whatever happened). So
the CLI first tries the insert under ``on_conflict="error"`` (nothing is written when
the key is held, and the refusal names the holder) and only then applies the asked
policy; comparing the job that policy returns with the holder tells skipped, replaced
and kept apart. Between the two statements the holder may finish: the policy then
inserts, and the line says so.
"""

from __future__ import annotations

import argparse
import getpass
import json
from datetime import timedelta
from typing import Any

import asyncpg

from scheduler.cli._util import (
    add_actions,
    add_shard_option,
    after_id,
    emit,
    job_id,
    job_tag,
    opened,
    parse_duration,
    parse_payload,
    parse_when,
    positive_int,
    print_json,
    print_table,
    say,
)
from scheduler.config import Settings
from scheduler.errors import InvalidInput, UniqueKeyTaken
from scheduler.shards.router import RoutedJob, ShardRouter
from scheduler.store import JobFilter, JobStore
from scheduler.store.jobs import ON_CONFLICT, OnConflict
from scheduler.store.rows import JOB_STATUSES, Job

LIST_COLUMNS = (
    "id", "task", "queue", "status", "attempt", "progress", "due_at", "run_at", "tags",
    "last_error",
)  # fmt: skip
#: CHECK jobs_priority_range (migration 0015), checked here so the line names the flag.
PRIORITY_RANGE = (-100, 100)


def priority(text: str) -> int:
    """``--priority``: an integer in ``PRIORITY_RANGE``."""
    low, high = PRIORITY_RANGE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"priority must be an integer, not {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"priority must be between {low} and {high}, not {text}")
    return value


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    jobs = sub.add_parser("jobs", help="enqueue and inspect jobs")
    jsub = jobs.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)

    add = jsub.add_parser("add", parents=[common], help="enqueue a job")
    add.add_argument("task", help="registered task name")
    when = add.add_mutually_exclusive_group()
    when.add_argument("--at", help="due time, ISO 8601 (no offset = UTC)")
    when.add_argument("--in", dest="in_", metavar="DURATION", help="due after e.g. 30s, 5m, 1h")
    add.add_argument("--payload", help="JSON object passed to the handler")
    add.add_argument("--queue", default="default")
    add.add_argument("--max-attempts", type=positive_int, default=5)
    add.add_argument("--key", help="idempotency key (default job:<id>)")
    add.add_argument(
        "--unique-key", metavar="KEY", help="at most one live job of the queue holds KEY"
    )
    add.add_argument(
        "--on-conflict",
        choices=ON_CONFLICT,
        help="when --unique-key is held: skip (default), replace (debounce) or error",
    )
    add.add_argument(
        "--unique-for",
        metavar="DURATION",
        help="keep --unique-key taken this long after the enqueue, e.g. 1h",
    )
    add.add_argument(
        "--priority", type=priority, default=0, help="-100..100, higher first (default 0)"
    )
    add.add_argument(
        "--limit-key",
        metavar="KEY",
        help="what per-key limits and fair queues count the job under (a tenant, a host)",
    )
    add.add_argument(
        "--tag",
        dest="tags",
        action="append",
        type=job_tag,
        metavar="TAG",
        help="what the job is about, to list, cancel or retry it by (repeatable)",
    )
    add.add_argument("--meta", help="JSON object kept with the job (not passed to the handler)")
    add.add_argument(
        "--shard",
        metavar="NAME",
        help="shard to write to (default: by --unique-key, else --key, else round-robin)",
    )
    add.add_argument("--json", action="store_true", help="print the job as JSON")
    add.set_defaults(func=run_add)

    lst = jsub.add_parser("list", parents=[common], help="list jobs (keyset pages by id)")
    lst.add_argument("--status", choices=JOB_STATUSES)
    lst.add_argument("--queue")
    lst.add_argument("--task")
    lst.add_argument("--due-from", help="ISO 8601, inclusive")
    lst.add_argument("--due-to", help="ISO 8601, exclusive")
    lst.add_argument(
        "--tag",
        dest="tags",
        action="append",
        type=job_tag,
        metavar="TAG",
        help="only jobs holding this tag (repeatable: jobs holding every one)",
    )
    lst.add_argument("--after", type=after_id, help="show jobs with id greater than this")
    lst.add_argument("--limit", type=positive_int, default=50)
    lst.add_argument("--json", action="store_true")
    add_shard_option(lst)
    lst.set_defaults(func=run_list)

    add_actions(jsub, common, (("show", "show one job", run_show),), "job_id", type=job_id)
    bulk_actions = (
        (
            "cancel",
            "cancel a pending or running job (its handler is stopped), or every one with "
            "--tag",
            run_cancel,
        ),
        ("retry", "send a dead job back to pending (attempts reset), or every one with --tag",
         run_retry),
    )  # fmt: skip
    for name, helptext, func in bulk_actions:
        parser = jsub.add_parser(name, parents=[common], help=helptext)
        parser.add_argument("job_id", type=job_id, nargs="?", help="the job (or use --tag)")
        parser.add_argument(
            "--tag",
            dest="tags",
            action="append",
            type=job_tag,
            metavar="TAG",
            help=f"{name} every job holding this tag instead (repeatable: every one of them)",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="with --tag: count the jobs, change nothing"
        )
        add_shard_option(parser)
        parser.add_argument("--json", action="store_true")
        parser.set_defaults(func=func)


def _emit(job: Job, as_json: bool) -> None:
    if as_json:
        print_json(job.to_dict())
        return
    for key, value in job.to_dict().items():
        shown = json.dumps(value) if isinstance(value, dict | list) or key == "result" else value
        if key == "attempt":  # the budget that applied (a failure records the task's own)
            shown = f"{job.attempt} of {job.max_attempts}"
        say(f"{key:16} {'-' if value is None else shown}")


async def run_add(args: argparse.Namespace, settings: Settings) -> int:
    payload = parse_payload(args.payload)
    meta = parse_payload(args.meta, flag="--meta") if args.meta is not None else None
    due_at = parse_when(args.at) if args.at else None
    delay = parse_duration(args.in_) if args.in_ else None
    if args.unique_key is None and (args.on_conflict or args.unique_for):
        raise InvalidInput("--on-conflict and --unique-for need --unique-key")
    unique_for = _unique_for(args.unique_for) if args.unique_for else None
    policy: OnConflict = args.on_conflict or "skip"
    router = await ShardRouter.open(settings, max_size=2)

    async def enqueue(on_conflict: OnConflict) -> RoutedJob:
        return await router.enqueue(
            args.task,
            payload,
            shard=args.shard,
            due_at=due_at,
            delay=delay,
            queue=args.queue,
            max_attempts=args.max_attempts,
            idempotency_key=args.key,
            unique_key=args.unique_key,
            on_conflict=on_conflict,
            unique_for=unique_for,
            priority=args.priority,
            limit_key=args.limit_key,
            tags=args.tags or (),
            meta=meta,
        )

    try:
        outcome = "inserted"
        try:
            routed = await enqueue("error" if args.unique_key else policy)
        except UniqueKeyTaken as taken:
            if policy == "error":
                raise
            routed = await enqueue(policy)
            outcome = _outcome(policy, taken.holder_id, routed)
    except asyncpg.CheckViolationError as exc:
        raise InvalidInput(f"refused by {exc.constraint_name}: {exc}") from None
    finally:
        await router.close()
    job = routed.job
    sharded = settings.shards is not None  # unsharded: no shard named (the K = 1 contract)
    where = f" in shard {routed.shard}" if sharded else ""
    about = f"({job.task}) due {job.next_run_at.isoformat()} on {job.queue}{where}"
    text = {
        "inserted": f"enqueued job {job.id} {about}",
        "skipped": f"skipped: held by job {job.id} {about}",
        "replaced": f"replaced: job {job.id} holds the key, now {about}",
        "kept": f"kept: held by job {job.id}, {job.status}, {about}",
    }[outcome]
    data = job.to_dict()
    if sharded:
        data["shard"] = routed.shard
    if args.unique_key is not None:
        data["unique_outcome"] = outcome
    return emit(args, data, text)


def _unique_for(text: str) -> timedelta:
    """``--unique-for``: a duration, 0 included (``JobStore`` checks the upper bound)."""
    return timedelta(0) if text.strip() in ("0", "0s") else parse_duration(text)


def _outcome(policy: OnConflict, holder_id: int | None, routed: RoutedJob) -> str:
    """What ``policy`` did, given the holder the "error" attempt was refused by."""
    if routed.job.id != holder_id:
        return "inserted"  # the holder finished meanwhile, or (replace) was due later
    if policy == "skip":
        return "skipped"
    return "replaced" if routed.job.status == "pending" else "kept"


async def run_list(args: argparse.Namespace, settings: Settings) -> int:
    due_from = parse_when(args.due_from) if args.due_from else None
    due_to = parse_when(args.due_to) if args.due_to else None
    if due_from and due_to and due_from >= due_to:
        raise InvalidInput("--due-from must be earlier than --due-to")
    async with opened(settings, JobStore, shard=args.shard) as store:
        jobs = await store.list(
            status=args.status,
            queue=args.queue,
            task=args.task,
            due_from=due_from,
            due_to=due_to,
            tags=args.tags or (),
            after_id=args.after,
            limit=args.limit,
        )
    if args.json:
        print_json([j.to_dict() for j in jobs])
        return 0
    print_table([_row(j) for j in jobs], LIST_COLUMNS)
    if len(jobs) == args.limit:
        say(f"... more: duetime jobs list --after {jobs[-1].id}")
    return 0


def _row(job: Job) -> dict[str, Any]:
    row = {c: getattr(job, c) for c in LIST_COLUMNS}
    row["attempt"] = f"{job.attempt}/{job.max_attempts}"
    row["progress"] = _progress(job)
    row["tags"] = _tags(job)
    if job.last_error and len(job.last_error) > 40:
        row["last_error"] = job.last_error[:37] + "..."
    return row


def _tags(job: Job) -> str | None:
    """The tags comma-separated (no tag holds a comma), cut to fit a table."""
    if not job.tags:
        return None
    shown = ",".join(job.tags)
    return shown if len(shown) <= 30 else shown[:27] + "..."


def _progress(job: Job) -> str | None:
    """``40% copied 4 of 10 files`` (the note cut to fit a table), or None."""
    if job.progress is None:
        return None
    shown = f"{job.progress:.0%}"
    if job.progress_note:
        note = job.progress_note
        shown += " " + (note if len(note) <= 30 else note[:27] + "...")
    return shown


async def _single(args: argparse.Namespace, settings: Settings, action: str) -> int:
    async with opened(settings, JobStore, shard=args.shard) as store:
        job = await getattr(store, action)(args.job_id)
    if action != "get" and not args.json:
        say(f"job {job.id} is now {job.status}")
    else:
        _emit(job, args.json)
    return 0


async def run_show(args: argparse.Namespace, settings: Settings) -> int:
    return await _single(args, settings, "get")


def _target(args: argparse.Namespace) -> JobFilter | None:
    """The jobs ``cancel``/``retry`` act on: one id, or (``--tag``) a filter."""
    if (args.job_id is None) == (not args.tags):
        raise InvalidInput("give a job id or --tag TAG (not both)")
    if args.dry_run and not args.tags:
        raise InvalidInput("--dry-run goes with --tag")
    return JobFilter(tags=args.tags) if args.tags else None


async def _by_tag(args: argparse.Namespace, settings: Settings, where: JobFilter) -> int:
    """``cancel``/``retry`` ``--tag``: the jobs matching now (pending, waiting and running for a
    cancel, dead for a retry), each changed once, in short batches
    (``JobStore.cancel_matching``/``retry_matching``)."""
    action = args.func.__name__.removeprefix("run_")
    async with opened(settings, JobStore, shard=args.shard) as store:
        preview = await store.preview_matching(action, where)
        if args.dry_run:
            changed = 0
        elif action == "cancel":
            changed = await store.cancel_matching(where, preview=preview, by=_who())
        else:
            changed = await store.retry_matching(where, preview=preview)
    tags = ", ".join(where.tags)
    states = "pending, waiting or running" if action == "cancel" else "dead"
    verb = {"cancel": "cancelled", "retry": "retried"}[action]
    text = (
        f"would {action} {preview.count} {states} job(s) tagged {tags} (dry run)"
        if args.dry_run
        else f"{verb} {changed} of {preview.count} {states} job(s) tagged {tags}"
    )
    data = {"action": action, "tags": list(where.tags), "matched": preview.count,
            "changed": changed, "dry_run": args.dry_run}  # fmt: skip
    return emit(args, data, text)


async def run_cancel(args: argparse.Namespace, settings: Settings) -> int:
    where = _target(args)
    if where is not None:
        return await _by_tag(args, settings, where)
    async with opened(settings, JobStore, shard=args.shard) as store:
        job = await store.cancel(args.job_id, by=_who())
    if args.json:
        _emit(job, True)
    else:
        say(f"job {job.id} is now cancelled")
    return 0


def _who() -> str:
    """``cancelled_by`` of a cancel from this command: the operating-system user."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name in this environment
        return "cli"


async def run_retry(args: argparse.Namespace, settings: Settings) -> int:
    where = _target(args)
    if where is not None:
        return await _by_tag(args, settings, where)
    return await _single(args, settings, "retry")
