"""``duetime migrate``: apply schema migrations (safe concurrently, idempotent)."""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.config import Settings
from scheduler.migrate import migrate


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser("migrate", parents=[common], help="create or upgrade the schema")
    parser.set_defaults(func=run)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    result = await migrate(settings.database_url, timeout=settings.db_timeout)
    if result.applied:
        print(f"applied {', '.join(result.applied)}; schema at version {result.current_version}")
    else:
        print(f"schema up to date at version {result.current_version}")
    return 0
