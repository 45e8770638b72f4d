"""``duetime dashboard``: serve the operations page until SIGTERM/SIGINT.

Binds 127.0.0.1:8089 by default (``--listen`` or DUETIME_DASHBOARD_LISTEN). With
DUETIME_DASHBOARD_TOKEN set every request needs the token (login form or
``Authorization: Bearer``); without one, only a loopback address is accepted.
``--read-only`` hides and refuses every action. See docs/dashboard.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.cli._util import SettingOverride, add_command
from scheduler.config import Settings

HELP = "serve the operations dashboard (jobs, schedules, cluster) in the browser"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = add_command(sub, common, "dashboard", HELP, __doc__)
    parser.add_argument(
        "--listen",
        dest="dashboard_listen",
        action=SettingOverride,
        metavar="HOST:PORT",
        help="address to serve on (env DUETIME_DASHBOARD_LISTEN, default 127.0.0.1:8089)",
    )
    parser.add_argument("--read-only", action="store_true", help="show no actions, refuse them")
    parser.set_defaults(func=run)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    from scheduler.dashboard.server import serve  # starlette/uvicorn only for this command

    return await serve(settings, read_only=args.read_only)
