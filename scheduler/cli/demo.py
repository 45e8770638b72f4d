"""``duetime demo``: the whole system live on this machine, with a failover, judged.

Drops and re-creates the demo database (``--database-name``, default duetime_demo, on
the server of ``--database-url``/DUETIME_DATABASE_URL), migrates it, starts scheduler
replicas and workers as child processes, publishes jobs due over ``--duration``
seconds plus two cron schedules, SIGKILLs the leader half way, and ends with a summary
(lost, duplicates, lag, failover time). Needs PostgreSQL, RabbitMQ and etcd: ``make
demo`` starts what is missing (``make services``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scheduler.cli._util import add_command, positive_int, seconds
from scheduler.config import Settings
from scheduler.log import configure_logging

EPILOG = """\
each run is isolated: its own etcd prefix (duetime-demo/<run id>) and queue
(demo-<run id>; its broker queues are deleted at the end); the demo database is
DROPPED and re-created at start (its name must contain 'demo') and kept afterwards
for inspection.

exit codes:
  0    every job ran exactly once (0 lost, 0 duplicates)
  1    something was lost or applied twice, or a service was unreachable
  2    bad flags
  130  interrupted (Ctrl-C / SIGTERM); every child process is stopped first
"""


HELP = "run a local cluster live: jobs, cron, a leader killed, a summary (0 lost)"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = add_command(sub, common, "demo", HELP, __doc__, EPILOG)
    parser.add_argument(
        "--duration",
        type=seconds,
        default=20.0,
        metavar="SECONDS",
        help="jobs are due over this many seconds (default %(default)g)",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=3000,
        metavar="N",
        help="one-shot jobs to publish (default %(default)s)",
    )
    parser.add_argument(
        "--replicas",
        type=positive_int,
        default=2,
        metavar="N",
        help="scheduler replicas (default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=2,
        metavar="N",
        help="worker processes (default %(default)s)",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=8,
        metavar="N",
        help="handlers at once per worker (default %(default)s)",
    )
    parser.add_argument(
        "--database-name",
        default="duetime_demo",
        metavar="NAME",
        help="demo database, DROPPED and re-created at start; must contain "
        "'demo' (default %(default)s)",
    )
    parser.add_argument(
        "--demo-lease-ttl",
        dest="demo_lease_ttl",
        type=seconds,
        default=3.0,
        metavar="SECONDS",
        help="lease TTL of the demo's replicas: the failover time (default %(default)g)",
    )
    parser.add_argument(
        "--grace",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long after --duration the backlog may take to drain (default %(default)g)",
    )
    parser.add_argument("--no-kill", action="store_true", help="do not kill the leader half way")
    parser.add_argument(
        "--no-dashboard",
        action="store_true",
        help="do not serve `duetime dashboard` (127.0.0.1:8089) while the demo runs",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=Path(".run/demo"),
        metavar="DIR",
        help="children's logs (default %(default)s)",
    )
    view = parser.add_mutually_exclusive_group()
    view.add_argument(
        "--live",
        dest="live",
        action="store_true",
        default=None,
        help="rich live view (default when stdout is a terminal)",
    )
    view.add_argument(
        "--plain",
        dest="live",
        action="store_false",
        help="a progress line every 2 s instead of the live view",
    )
    parser.add_argument(
        "--summary-json", type=Path, metavar="FILE", help="also write the summary as JSON to FILE"
    )
    parser.set_defaults(func=run)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    from demo.config import DemoConfig
    from demo.runner import run_demo

    if settings.log_level == "info":  # the view is the output; children log to files
        configure_logging("warning", settings.log_format)

    cfg = DemoConfig(
        duration=args.duration,
        jobs=args.jobs,
        replicas=args.replicas,
        workers=args.workers,
        concurrency=args.concurrency,
        database_name=args.database_name,
        lease_ttl=args.demo_lease_ttl,
        grace=args.grace,
        log_dir=args.log_dir,
        kill_leader=not args.no_kill,
        live=args.live,
        summary_json=args.summary_json,
        dashboard=not args.no_dashboard,
    )
    return await run_demo(settings, cfg)
