"""``duetime status``: leader, per-queue backlog, whether RabbitMQ is reachable and who
consumes each queue, and schedules, with a monitoring exit code.

With shards configured (``DUETIME_SHARDS``) it shows one row per shard instead (leader,
etcd epoch, fence epoch, backlog) and the members (``scheduler.shards.status``).
"""

from __future__ import annotations

import argparse
from typing import Any

from scheduler import db
from scheduler.cli._util import print_json, print_table, say
from scheduler.config import Settings
from scheduler.dashboard.present import age_parts
from scheduler.errors import ServiceUnavailable
from scheduler.shards.status import ShardedReport, ShardStatus, collect_shard_status
from scheduler.status import (
    DEFAULT_MAX_UNSTARTED_AGE,
    STALE_RENEWALS,
    StatusReport,
    collect_status,
)

DEFAULT_MAX_BACKLOG_AGE = 60.0

EPILOG = f"""\
exit codes:
  0  healthy: a live leader, no due job older than --max-backlog-age, RabbitMQ
     reachable, and every queue holding jobs dispatched longer than
     --max-unstarted-age ago has a consumer
  1  unhealthy: no leader (the election key <prefix>/leader is absent in etcd, or the
     database fence was last renewed more than {STALE_RENEWALS} x DUETIME_LEASE_TTL ago),
     or the oldest due pending job is older than --max-backlog-age, or PostgreSQL
     cannot be reached, or RabbitMQ cannot be reached (broker_unreachable), or a queue
     holds dispatched jobs no worker started for longer than --max-unstarted-age and
     has no consumer (no_consumers): nothing executes them. The last line says why:
     "status: UNHEALTHY: <the first problem>"
  2  bad flags or configuration

RabbitMQ is asked on one connection, with a passive queue.declare per queue the
database names (its consumer and ready-message counts; no queue is ever created),
within --broker-timeout. "Not started" means dispatched with no heartbeat from a
worker yet (a handler's first heartbeat comes DUETIME_VISIBILITY_TIMEOUT / 3 after it
starts); the age counts from the job's last dispatch. Such jobs with consumers present
are a warning (unstarted_too_old: workers busy or slow), not a failure.

etcd being unreachable from this host is a warning, not a failure: the fence in
PostgreSQL still shows whether a leader is alive. --json prints the same report as a
JSON object (keys: healthy, problems, warnings, thresholds, leader, etcd, broker,
queues, schedules).

With shards (DUETIME_SHARDS or a [shards] table) every shard is judged like the one
database above, from its own election key <prefix>/shards/<name>/leader and its own
database; a shard that cannot be reached is shown with its error and makes the exit
code 1, and the others are still shown. RabbitMQ (shared by the shards) is read once,
for the queues of every shard, and each shard is judged against it. --json then has
the keys healthy, problems, warnings (each naming its shard), etcd, broker, members,
and shards (one object per shard: name, reachable, error, healthy, etcd, leader,
backlog, queues, schedules).
"""

QUEUE_COLUMNS = ("queue", "pending", "due_now", "oldest_overdue", "dispatched", "unstarted",
                 "oldest_unstarted", "consumers", "dead_1h", "held")  # fmt: skip
SHARD_COLUMNS = ("shard", "leader", "epoch", "fence_epoch", "renewed", "pending", "due_now",
                 "oldest_overdue", "dispatched", "unstarted", "oldest_unstarted", "dead_1h",
                 "state")  # fmt: skip


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "status",
        parents=[common],
        help="cluster health: leader, backlog per queue, schedules (exit 1 when unhealthy)",
        description="Show the current leader, the backlog per queue and the schedules.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--max-backlog-age",
        type=_seconds,
        default=DEFAULT_MAX_BACKLOG_AGE,
        metavar="SECONDS",
        help="unhealthy when a due job has waited longer than this (default %(default)g)",
    )
    parser.add_argument(
        "--max-unstarted-age",
        type=_seconds,
        default=DEFAULT_MAX_UNSTARTED_AGE,
        metavar="SECONDS",
        help="unhealthy when a queue without consumers holds a job dispatched longer ago "
        "than this that no worker started (default %(default)g)",
    )
    parser.add_argument(
        "--broker-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="RabbitMQ read timeout, connection and queue reads together "
        "(default DUETIME_AMQP_TIMEOUT)",
    )
    parser.add_argument(
        "--etcd-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="etcd read timeout (default DUETIME_ETCD_TIMEOUT)",
    )
    parser.set_defaults(func=run)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    if settings.shards is not None:
        sharded = await collect_shard_status(
            settings,
            max_backlog_age=args.max_backlog_age,
            etcd_timeout=args.etcd_timeout,
            max_unstarted_age=args.max_unstarted_age,
            broker_timeout=args.broker_timeout,
        )
        if args.json:
            print_json(sharded.to_dict())
        else:
            render_shards(sharded)
        return sharded.exit_code
    try:
        pool = await db.pool_from_settings(
            settings,
            max_size=1,
            min_size=1,
            server_settings={"statement_timeout": str(int(settings.db_timeout * 1000))},
        )
    except ServiceUnavailable as exc:
        if not args.json:
            raise
        print_json(
            {
                "healthy": False,
                "problems": [{"code": "database_unreachable", "message": str(exc)}],
                "warnings": [],
            }
        )
        return 1
    try:
        report = await collect_status(
            settings,
            pool,
            max_backlog_age=args.max_backlog_age,
            etcd_timeout=args.etcd_timeout,
            max_unstarted_age=args.max_unstarted_age,
            broker_timeout=args.broker_timeout,
        )
    finally:
        await pool.close()
    if args.json:
        print_json(report.to_dict())
    else:
        render(report)
    return report.exit_code


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    big, big_unit, small, small_unit = age_parts(seconds)
    return f"{big}{big_unit}{small:02d}{small_unit}"


def render(report: StatusReport) -> None:
    snap, etcd, fence = report.snapshot, report.etcd, report.snapshot.fence
    if fence.epoch:
        say(
            f"leader     {fence.leader_node or '-'}  epoch {fence.epoch}  "
            f"since {_ts(fence.elected_at)} ({_age(fence.elected_age)} ago)  "
            f"last renew {_age(fence.renewed_age)} ago"
        )
    else:
        say("leader     none has ever fenced the database")
    if not etcd.reachable:
        say(f"etcd       unreachable: {etcd.error}")
    elif etcd.leader is None:
        say(f"etcd       {etcd.key} absent (no leader) via {etcd.endpoint}")
    else:
        lease = (
            f", lease {etcd.lease_remaining:g}s left" if etcd.lease_remaining is not None else ""
        )
        say(
            f"etcd       {etcd.key} = {etcd.leader} (epoch {etcd.epoch}{lease}) via {etcd.endpoint}"
        )
    broker = report.broker
    if broker is not None and not broker.reachable:
        say(f"broker     unreachable: {broker.error}")
    elif broker is not None:
        say(f"broker     reachable ({len(broker.queues)} queue(s) read)")
    say()
    if snap.queues:
        rows = [
            {
                "queue": q.queue,
                "pending": q.pending,
                "due_now": q.due_now,
                "oldest_overdue": _age(q.oldest_overdue) if q.oldest_overdue is not None else None,
                "dispatched": q.dispatched,
                "unstarted": q.unstarted,
                "oldest_unstarted": _age(q.oldest_unstarted)
                if q.oldest_unstarted is not None
                else None,
                "consumers": broker.consumers(q.queue) if broker and broker.reachable else None,
                "dead_1h": q.dead_last_hour,
                "held": "" if q.declared else f"{q.held} (queue not declared)",
            }
            for q in snap.queues
        ]
        print_table(rows, QUEUE_COLUMNS)
    else:
        say("queues     no pending, dispatched or recently dead jobs")
    if snap.waiting:
        say(f"workflows  {snap.waiting} job(s) waiting for their dependencies")
    say()
    sched = snap.schedules
    if sched is None:
        say("schedules  (table duetime.schedules not present: run duetime migrate)")
    else:
        nxt = ""
        if sched.upcoming:
            first = sched.upcoming[0]
            when = (
                f"in {_age(first.fires_in)}"
                if first.fires_in >= 0
                else f"{_age(-first.fires_in)} overdue"
            )
            nxt = f"; next fire {first.name} at {_ts(first.next_fire_at)} ({when})"
        say(f"schedules  {sched.total} ({sched.paused} paused){nxt}")
    say()
    for warning in report.warnings:
        say(f"warning: {warning.message}")
    for problem in report.problems:
        say(f"PROBLEM: {problem.message}")
    say("status: OK" if report.healthy else f"status: UNHEALTHY: {report.reason}")


def _shard_row(shard: ShardStatus) -> dict[str, Any]:
    row: dict[str, Any] = {
        "shard": shard.name, "leader": shard.etcd.leader, "epoch": shard.etcd.epoch
    }  # fmt: skip
    if shard.report is None:
        return {**row, "state": "UNREACHABLE"}
    fence, backlog = shard.report.snapshot.fence, shard.backlog() or {}
    overdue, waited = backlog.get("oldest_overdue"), backlog.get("oldest_unstarted")
    row.update(
        leader=shard.etcd.leader or fence.leader_node,
        fence_epoch=fence.epoch,
        renewed=_age(fence.renewed_age) if fence.epoch else None,
        pending=backlog.get("pending"),
        due_now=backlog.get("due_now"),
        oldest_overdue=_age(overdue) if overdue is not None else None,
        dispatched=backlog.get("dispatched"),
        unstarted=backlog.get("unstarted"),
        oldest_unstarted=_age(waited) if waited is not None else None,
        dead_1h=backlog.get("dead_last_hour"),
        state=",".join(sorted({p.code for p in shard.problems})) or "ok",
    )
    return row


def render_shards(report: ShardedReport) -> None:
    print_table([_shard_row(s) for s in report.shards], SHARD_COLUMNS)
    say()
    etcd = report.etcd
    if not etcd.reachable:
        say(f"etcd       unreachable: {etcd.error}")
    else:
        members = ", ".join(
            m.node + (f" (lease {m.lease_remaining:g}s left)" if m.lease_remaining else "")
            for m in etcd.members
        )
        shown = members or "none registered"
        say(f"members    {len(etcd.members)}: {shown} (via {etcd.endpoint})")
    if report.broker is not None and not report.broker.reachable:
        say(f"broker     unreachable: {report.broker.error}")
    elif report.broker is not None:
        say(f"broker     reachable ({len(report.broker.queues)} queue(s) read)")
    for shard in report.shards:
        if shard.report is None:
            say(f"shard {shard.name}: unreachable: {shard.error}")
    say()
    for shard_name, warning in report.findings("warnings"):
        where = "" if shard_name is None else f"shard {shard_name}: "
        say(f"warning: {where}{warning.message}")
    problems = [
        ("" if shard_name is None else f"shard {shard_name}: ") + problem.message
        for shard_name, problem in report.findings("problems")
    ]
    for problem_text in problems:
        say(f"PROBLEM: {problem_text}")
    say(f"status: UNHEALTHY: {problems[0]}" if problems else "status: OK")


def _ts(value: Any) -> str:
    return value.isoformat(timespec="seconds") if value is not None else "-"
