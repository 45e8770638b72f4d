"""``duetime migrate``: apply schema migrations (safe concurrently, idempotent).

``--roles`` also creates and grants the least-privilege group roles afterwards
(``scheduler/roles.py``, docs/security.md); it needs a role allowed to CREATE ROLE.
"""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.config import Settings
from scheduler.errors import InvalidInput
from scheduler.migrate import MigrationResult, migrate, migrate_shards
from scheduler.roles import DEFAULT_PREFIX, RoleNames, apply_roles
from scheduler.store.queues import declare_queues


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser("migrate", parents=[common], help="create or upgrade the schema")
    parser.add_argument(
        "--shard", metavar="NAME", help="migrate only this shard (default: every shard)"
    )
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
    urls = _selected_shards(settings, getattr(args, "shard", None))
    if settings.shards is None:  # unsharded: the one database, no shard named in the output
        print(_summary("", await migrate(settings.database_url, timeout=settings.db_timeout)))
    else:
        await migrate_shards(
            urls,
            timeout=settings.db_timeout,
            on_migrated=lambda shard, result: print(_summary(shard, result), flush=True),
        )
    if settings.queues:
        for shard, url in urls.items():
            added = await declare_queues(url, settings.queues, timeout=settings.db_timeout)
            where = f"shard {shard}: " if settings.shards is not None else ""
            print(
                f"{where}queues declared from the configuration: {', '.join(settings.queues)}"
                f" ({added} new)"
            )
    if getattr(args, "roles", False):
        for url in urls.values():
            names = await apply_roles(
                url,
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


def _selected_shards(settings: Settings, shard: str | None) -> dict[str, str]:
    urls = settings.shard_urls
    if shard is None:
        return urls
    if shard not in urls:
        raise InvalidInput(f"--shard {shard!r} is not a configured shard ({', '.join(urls)})")
    return {shard: urls[shard]}


def _summary(shard: str, result: MigrationResult) -> str:
    prefix = f"shard {shard}: " if shard else ""
    if result.applied:
        return (
            f"{prefix}applied {', '.join(result.applied)}; "
            f"schema at version {result.current_version}"
        )
    return f"{prefix}schema up to date at version {result.current_version}"
