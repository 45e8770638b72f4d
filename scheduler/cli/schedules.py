"""``duetime schedules add|apply|list|show|pause|resume|remove|trigger``.

Every value is checked before the database is touched (a bad cron expression, time
zone, interval or policy exits 2 with one ``duetime: error:`` line naming it), so these
options are parsed here rather than by argparse types, whose errors look different.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from scheduler.cli._util import (
    add_actions,
    add_shard_option,
    emit,
    opened,
    parse_duration,
    parse_payload,
    parse_when,
    print_json,
    print_table,
    say,
)
from scheduler.clock import SYSTEM_CLOCK
from scheduler.config import Settings
from scheduler.cron import ScheduleSpecError
from scheduler.errors import InvalidInput
from scheduler.planning import (
    DEFAULT_MISFIRE_CAP,
    Schedule,
    ScheduleSpec,
    format_duration,
    upcoming_fire_times,
)
from scheduler.planning.declared import SOURCE_PATTERN, Change, parse_declaration
from scheduler.store.rows import Job
from scheduler.store.schedules import ScheduleConflict, ScheduleStore

LIST_COLUMNS = (
    "id", "name", "task", "every", "timezone", "next_fire_at", "paused", "fired_count",
    "missed_count", "skipped_count", "last_error",
)  # fmt: skip
RUN_COLUMNS = ("id", "status", "attempt", "due_at", "dispatched_at", "finished_at", "last_error")
UPCOMING = 5


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    schedules = sub.add_parser("schedules", help="recurring schedules (cron or interval)")
    ssub = schedules.add_subparsers(dest="schedules_command", metavar="ACTION", required=True)

    add = ssub.add_parser(
        "add",
        parents=[common],
        help="create a schedule",
        description="Create a schedule firing TASK on a cron expression (5 fields, or 6 "
        "with seconds first, or @hourly-style aliases) in a time zone, or every DURATION.",
    )
    add.add_argument("name", help="unique schedule name")
    add.add_argument("task", help="registered task name")
    add.add_argument("--cron", metavar="EXPR", help="e.g. '30 2 * * *' or '*/15 * * * * *'")
    add.add_argument("--every", metavar="DURATION", help="fixed period, e.g. 30s, 5m, 1h30m")
    add.add_argument("--tz", default="UTC", help="IANA time zone for --cron (default UTC)")
    add.add_argument("--payload", help="JSON object passed to the handler")
    add.add_argument("--queue", default="default")
    add.add_argument("--max-attempts", default="5", metavar="N")
    add.add_argument(
        "--misfire", default="skip", help="skip (default) | fire_once | fire_all: missed fire times"
    )
    add.add_argument(
        "--misfire-cap",
        default=str(DEFAULT_MISFIRE_CAP),
        metavar="N",
        help=f"fire_all: catch up at most N (default {DEFAULT_MISFIRE_CAP})",
    )
    add.add_argument(
        "--overlap",
        default="allow",
        help="allow (default) | skip: not while the previous run is unfinished | buffer_one",
    )
    add.add_argument(
        "--jitter", default="0", metavar="SECONDS", help="spread each fire over 0..SECONDS"
    )
    add.add_argument("--start-at", help="first possible fire time, ISO 8601 (no offset = UTC)")
    add.add_argument("--end-at", help="last possible fire time, ISO 8601 (no offset = UTC)")
    add.add_argument("--paused", action="store_true", help="create it paused")
    add.add_argument("--json", action="store_true")
    add_shard_option(add)
    add.set_defaults(func=run_add)

    lst = ssub.add_parser("list", parents=[common], help="list schedules")
    state = lst.add_mutually_exclusive_group()
    state.add_argument("--paused", dest="paused", action="store_const", const=True)
    state.add_argument("--active", dest="paused", action="store_const", const=False)
    lst.add_argument("--after", default=None, metavar="ID", help="schedules with a larger id")
    lst.add_argument("--limit", default="100", metavar="N")
    lst.add_argument("--json", action="store_true")
    add_shard_option(lst)
    lst.set_defaults(func=run_list)

    show = ssub.add_parser(
        "show", parents=[common], help="one schedule, its next fire times and recent runs"
    )
    show.add_argument("schedule", help="name or id")
    show.add_argument("--runs", default="10", metavar="N", help="recent runs shown (default 10)")
    show.add_argument("--json", action="store_true")
    add_shard_option(show)
    show.set_defaults(func=run_show)

    apply = ssub.add_parser(
        "apply",
        parents=[common],
        help="create or update the schedules a TOML file declares",
        description="Make the schedules agree with FILE (schedules as code): create the "
        "missing, redefine the changed (their jobs planned ahead are cancelled and they are "
        "planned again from now), leave the rest alone; idempotent and safe to run from "
        "every deploy at once. A schedule made by hand is never changed or removed unless "
        "--adopt. See docs/api.md 'Schedules as code'.",
    )
    apply.add_argument("file", help="the declaration (TOML)")
    apply.add_argument("--dry-run", action="store_true", help="print the changes, write nothing")
    apply.add_argument(
        "--prune", action="store_true",
        help="remove this source's schedules the file no longer declares",
    )  # fmt: skip
    apply.add_argument(
        "--adopt", action="store_true",
        help="manage same-named schedules made by hand or by another source from this file",
    )  # fmt: skip
    apply.add_argument(
        "--source", metavar="NAME",
        help="who owns these schedules (overrides the file's 'source'; default: its name)",
    )  # fmt: skip
    apply.add_argument("--json", action="store_true")
    add_shard_option(apply)
    apply.set_defaults(func=run_apply)

    actions = (
        ("pause", "stop planning (jobs planned ahead are cancelled)", run_pause),
        ("resume", "plan again from now", run_resume),
        ("remove", "delete (jobs planned ahead are cancelled)", run_remove),
        ("trigger", "fire once now, outside the schedule", run_trigger),
    )
    add_actions(ssub, common, actions, "schedule", help="name or id")


# -- parsing (before any connection) ----------------------------------------------------


def _int(text: str, flag: str, *, minimum: int = 1) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise InvalidInput(f"{flag} must be an integer, not {text!r}") from None
    if value < minimum:
        raise InvalidInput(f"{flag} must be >= {minimum}, not {text!r}")
    return value


def _seconds(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_duration(text).total_seconds()
    except InvalidInput:
        raise InvalidInput(f"{flag} must be seconds or a duration like 30s, not {text!r}") from None


def spec_from_args(args: argparse.Namespace) -> ScheduleSpec:
    """The schedule ``add`` asks for, validated (raises ``InvalidInput``)."""
    if (args.cron is None) == (args.every is None):
        raise InvalidInput("give exactly one of --cron EXPR and --every DURATION")
    return ScheduleSpec(
        name=args.name,
        task=args.task,
        cron=args.cron,
        interval=args.every,
        timezone=args.tz,
        payload=parse_payload(args.payload),
        queue=args.queue,
        max_attempts=_int(args.max_attempts, "--max-attempts"),
        start_at=parse_when(args.start_at) if args.start_at else None,
        end_at=parse_when(args.end_at) if args.end_at else None,
        paused=args.paused,
        misfire_policy=args.misfire,
        misfire_cap=_int(args.misfire_cap, "--misfire-cap"),
        overlap_policy=args.overlap,
        jitter=_seconds(args.jitter, "--jitter"),
    )


# -- commands ----------------------------------------------------------------------------


async def run_add(args: argparse.Namespace, settings: Settings) -> int:
    spec = spec_from_args(args)
    async with opened(settings, ScheduleStore, shard=args.shard) as store:
        schedule = await store.add(spec)
    if args.json:
        print_json(schedule.to_dict())
        return 0
    upcoming = upcoming_fire_times(schedule, SYSTEM_CLOCK.now(), 1)
    first = f"; first fire {_utc(upcoming[0])}" if upcoming else ""
    state = " (paused)" if schedule.paused else ""
    say(f"created schedule {schedule.id} {schedule.name!r}: {_describe(schedule)}{state}{first}")
    return 0


async def run_list(args: argparse.Namespace, settings: Settings) -> int:
    after = _int(args.after, "--after", minimum=0) if args.after is not None else None
    limit = _int(args.limit, "--limit")
    async with opened(settings, ScheduleStore, shard=args.shard) as store:
        schedules = await store.list(paused=args.paused, after_id=after, limit=limit)
    if args.json:
        print_json([s.to_dict() for s in schedules])
        return 0
    print_table([_row(s, LIST_COLUMNS) for s in schedules], LIST_COLUMNS)
    if len(schedules) == limit:
        say(f"... more: duetime schedules list --after {schedules[-1].id}")
    return 0


async def run_show(args: argparse.Namespace, settings: Settings) -> int:
    runs_limit = _int(args.runs, "--runs", minimum=0)
    async with opened(settings, ScheduleStore, shard=args.shard) as store:
        schedule = await store.get(args.schedule)
        runs = await store.recent_runs(schedule.id, runs_limit) if runs_limit else []
    now = SYSTEM_CLOCK.now()
    try:
        upcoming = upcoming_fire_times(schedule, now, UPCOMING)
        zone: ZoneInfo | None = ZoneInfo(schedule.timezone)
        problem = None
    except ScheduleSpecError as exc:
        upcoming, zone, problem = [], None, str(exc)
    if args.json:
        print_json(
            {
                "schedule": schedule.to_dict(),
                "upcoming": [
                    {"utc": _iso_utc(t), "local": t.astimezone(zone).isoformat()}
                    for t in upcoming
                    if zone is not None
                ],
                "upcoming_error": problem,
                "recent_runs": [job.to_dict() for job in runs],
            }
        )
        return 0
    _print_schedule(schedule)
    say()
    note = " (paused: none will fire until resumed)" if schedule.paused else ""
    say(f"next {UPCOMING} fire times ({schedule.timezone} / UTC){note}:")
    if problem:
        say(f"  unavailable: {problem}")
    elif not upcoming:
        say("  none (the schedule has ended)")
    for t in upcoming:
        assert zone is not None
        say(f"  {_local(t, zone):32}  {_utc(t)}")
    say()
    say(f"recent runs ({len(runs)}):")
    if runs:
        print_table([_row(job, RUN_COLUMNS) for job in runs], RUN_COLUMNS)
    else:
        say("  none yet")
    return 0


async def run_pause(args: argparse.Namespace, settings: Settings) -> int:
    return await _cancelling_planned(
        args, settings, "pause", "paused schedule {} {!r}; {} planned job(s) cancelled"
    )


async def run_resume(args: argparse.Namespace, settings: Settings) -> int:
    async with opened(settings, ScheduleStore, shard=args.shard) as store:
        schedule = await store.resume(args.schedule)
    text = f"resumed schedule {schedule.id} {schedule.name!r}; it fires again from now"
    return emit(args, schedule.to_dict(), text)


async def run_remove(args: argparse.Namespace, settings: Settings) -> int:
    return await _cancelling_planned(
        args, settings, "remove", "removed schedule {} {!r}; cancelled {} job(s)"
    )


async def _cancelling_planned(
    args: argparse.Namespace, settings: Settings, action: str, text: str
) -> int:
    """``pause`` or ``remove``: the store cancels the jobs planned ahead, and says how
    many; ``text`` is formatted with the schedule's id, its name and that count."""
    async with opened(settings, ScheduleStore, shard=args.shard) as store:
        schedule, cancelled = await getattr(store, action)(args.schedule)
    return emit(
        args,
        {"schedule": schedule.to_dict(), "cancelled_jobs": cancelled},
        text.format(schedule.id, schedule.name, cancelled),
    )


async def run_apply(args: argparse.Namespace, settings: Settings) -> int:
    path = Path(args.file)
    try:
        text = await asyncio.to_thread(path.read_text, encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read {args.file}: {exc}") from None
    declaration = parse_declaration(text, origin=str(path), default_source=path.name)
    if args.source is not None:
        if SOURCE_PATTERN.fullmatch(args.source) is None:
            raise InvalidInput(
                f"--source must be 1-200 characters [A-Za-z0-9_.:/-] (got {args.source!r})"
            )
        declaration = dataclasses.replace(declaration, source=args.source)
    async with opened(settings, ScheduleStore, shard=args.shard) as store:
        try:
            result = await store.apply(
                declaration, prune=args.prune, adopt=args.adopt, dry_run=args.dry_run
            )
        except ScheduleConflict as exc:
            raise InvalidInput(f"{exc} (--adopt takes them over)") from None
    if args.json:
        print_json(
            {
                "source": result.source,
                "dry_run": result.dry_run,
                "changes": [c.to_dict() for c in result.changes],
                "cancelled_jobs": result.cancelled,
            }
        )
        return 0
    verb = "would apply (dry run, nothing written)" if result.dry_run else "applied"
    counts = ", ".join(
        f"{result.count(kind)} {label}"
        for kind, label in (
            ("create", "created"), ("update", "updated"), ("unchanged", "unchanged"),
            ("remove", "removed"), ("undeclared", "undeclared"),
        )
        if result.count(kind)
    )  # fmt: skip
    say(f"{verb} {path} (source {result.source!r}): {counts or 'nothing declared'}")
    for change in result.changes:
        line = _change_line(change, result.cancelled.get(change.name, 0))
        if line:
            say(line)
    return 0


def _change_line(change: Change, cancelled: int) -> str | None:
    planned = f" ({cancelled} planned job(s) cancelled)" if cancelled else ""
    if change.kind == "create":
        assert change.declared is not None
        spec = change.declared.spec
        timing = f"cron {spec.cron!r} in {spec.timezone}" if spec.cron else (
            f"every {format_duration(spec.interval)}"
            if isinstance(spec.interval, timedelta) else "")  # fmt: skip
        paused = " (paused)" if change.declared.paused else ""
        return f"+ {change.name}: {spec.task}, {timing}{paused}"
    if change.kind == "update":
        fields = "; ".join(f"{k} {a} -> {b}" for k, (a, b) in change.fields.items())
        return f"~ {change.name}: {fields}{planned}"
    if change.kind == "remove":
        return f"- {change.name}: removed{planned}"
    if change.kind == "undeclared":
        return f"? {change.name}: no longer declared, kept (--prune removes it)"
    return None


async def run_trigger(args: argparse.Namespace, settings: Settings) -> int:
    async with opened(settings, ScheduleStore, shard=args.shard) as store:
        job = await store.trigger(args.schedule)
    text = f"triggered: job {job.id} ({job.task}) due now, key {job.idempotency_key}"
    return emit(args, job.to_dict(), text)


# -- output ------------------------------------------------------------------------------


def _describe(s: Schedule) -> str:
    if s.cron is not None:
        return f"cron {s.cron!r} in {s.timezone}"
    return s.every


def _iso_utc(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _utc(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _local(t: datetime, zone: ZoneInfo) -> str:
    local = t.astimezone(zone)
    return local.strftime("%Y-%m-%d %H:%M:%S %Z (%z)")


def _print_schedule(s: Schedule) -> None:
    for key, value in s.to_dict().items():
        shown = json.dumps(value) if isinstance(value, dict) else value
        say(f"{key:16} {'-' if value is None else shown}")


def _row(item: Schedule | Job, columns: tuple[str, ...]) -> dict[str, Any]:
    """A table row of ``columns``, the error cut to fit."""
    row = {c: getattr(item, c) for c in columns}
    if item.last_error and len(item.last_error) > 40:
        row["last_error"] = item.last_error[:37] + "..."
    return row
