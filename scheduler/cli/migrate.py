"""``duetime migrate``: apply schema migrations (safe concurrently, idempotent).

``--roles`` also creates and grants the least-privilege group roles afterwards
(``scheduler/roles.py``, docs/security.md); it needs a role allowed to CREATE ROLE.
"""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.config import Settings
from scheduler.migrate import migrate
from scheduler.roles import DEFAULT_PREFIX, RoleNames, apply_roles


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser("migrate", parents=[common], help="create or upgrade the schema")
    roles = parser.add_argument_group("roles (docs/security.md)")
    roles.add_argument(
        "--roles",
        action="store_true",
        help="also create/grant the NOLOGIN group roles <prefix>_producer, _worker, _scheduler",
    )
    roles.add_argument(
        "--roles-prefix",
        default=DEFAULT_PREFIX,
        metavar="PREFIX",
        help=f"group role name prefix (default {DEFAULT_PREFIX}); roles are cluster-wide",
    )
    roles.add_argument(
        "--producer-schedules",
        action="store_true",
        help="let producers insert recurring schedules too (default: jobs only)",
    )
    parser.set_defaults(func=run)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    if getattr(args, "roles", False):
        RoleNames.for_prefix(args.roles_prefix)  # a bad prefix fails before anything runs
    result = await migrate(settings.database_url, timeout=settings.db_timeout)
    if result.applied:
        print(f"applied {', '.join(result.applied)}; schema at version {result.current_version}")
    else:
        print(f"schema up to date at version {result.current_version}")
    if getattr(args, "roles", False):
        names = await apply_roles(
            settings.database_url,
            prefix=args.roles_prefix,
            producer_schedules=args.producer_schedules,
            timeout=settings.db_timeout,
        )
        scope = "jobs and schedules" if args.producer_schedules else "jobs"
        print(
            f"roles granted: {names.producer} (inserts {scope}), {names.worker}, "
            f"{names.scheduler}; create logins with "
            f"CREATE ROLE <user> LOGIN PASSWORD '...' IN ROLE <role>"
        )
    return 0
