"""The ``duetime`` command (DESIGN §7).

Each sub-command lives in its own module under ``scheduler/cli`` and exposes
``register(subparsers, common)``; this module only builds the parser, loads settings
(defaults < TOML < environment < flags), configures logging and maps errors to exit
codes: a ``DuetimeError`` prints one line and exits with its code (2 for bad input,
1 for an unreachable service); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import asyncpg

from scheduler import eventloop
from scheduler.cli._util import printable
from scheduler.config import Settings, load_settings
from scheduler.errors import DuetimeError
from scheduler.log import configure_logging, scrub

COMMAND_MODULES = (
    "migrate",
    "jobs",
    "workflows",
    "schedules",
    "queues",
    "limits",
    "scheduler_cmd",
    "worker_cmd",
    "status",
    "demo",
    "bench",
    "dashboard",
)

# Flags every command accepts; each maps to a Settings field of the same name.
COMMON_FLAGS: tuple[tuple[str, str], ...] = (
    ("--database-url", "PostgreSQL URL (env DUETIME_DATABASE_URL)"),
    ("--amqp-url", "RabbitMQ URL (env DUETIME_AMQP_URL)"),
    ("--etcd-endpoints", "etcd host:port list (env DUETIME_ETCD_ENDPOINTS)"),
    ("--etcd-prefix", "etcd key prefix (env DUETIME_ETCD_PREFIX)"),
    ("--node-id", "node id of this process (env DUETIME_NODE_ID)"),
    ("--lease-ttl", "leader lease TTL seconds (env DUETIME_LEASE_TTL)"),
    ("--metrics-port", "serve Prometheus /metrics here (env DUETIME_METRICS_PORT)"),
    ("--log-level", "debug|info|warning|error"),
    ("--log-format", "auto|json|console"),
)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (like every other duetime error) that
    points at ``--help``, exit code 2 — not the whole usage block.

    ``add_arguments_later``, when a sub-command sets it, is called once with the parser
    right before it parses: only the command actually run pays for (and imports) what
    its arguments need — ``duetime bench`` loads the benchmarks there and nowhere else.
    """

    add_arguments_later: Callable[[argparse.ArgumentParser], None] | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        populate, self.add_arguments_later = self.add_arguments_later, None
        if populate is not None:
            populate(self)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"duetime: error: {message} (see: {self.prog} --help)\n")


def common_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    group = common.add_argument_group("configuration")
    group.add_argument("--config", metavar="FILE", help="TOML config file (env DUETIME_CONFIG)")
    for flag, help_text in COMMON_FLAGS:
        group.add_argument(flag, help=help_text, default=None)
    return common


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {
        flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"), None)
        for flag, _ in COMMON_FLAGS
    }
    extra: dict[str, Any] = getattr(args, "settings_overrides", None) or {}
    overrides.update({k: v for k, v in extra.items() if v is not None})
    return load_settings(config_file=getattr(args, "config", None), overrides=overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="duetime",
        description="duetime: distributed job scheduler (PostgreSQL + etcd + RabbitMQ).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = common_parser()
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"scheduler.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"scheduler.cli.{name}":
                continue
            raise
        module.register(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
        configure_logging(settings.log_level, settings.log_format)
        func = args.func
        result = func(args, settings)
        if inspect.iscoroutine(result):
            result = eventloop.run(result, settings.event_loop)
        return int(result or 0)
    except DuetimeError as exc:
        print(f"duetime: error: {printable(scrub(str(exc)))}", file=sys.stderr)
        return exc.exit_code
    except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError) as exc:
        print(
            f"duetime: error: the duetime schema is missing or incomplete ({exc}); "
            "run `duetime migrate` first",
            file=sys.stderr,
        )
        return 1
    except asyncpg.InsufficientPrivilegeError as exc:
        print(
            f"duetime: error: permission denied: {printable(scrub(str(exc)))} (the database "
            "login lacks a grant: docs/security.md, PostgreSQL roles)",
            file=sys.stderr,
        )
        return 1
    except asyncpg.PostgresError as exc:
        print(
            f"duetime: error: PostgreSQL: {type(exc).__name__}: {printable(scrub(str(exc)))}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `duetime jobs list | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
