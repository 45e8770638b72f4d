"""``duetime bench SCENARIO [--quick]``: the benchmarks (docs/benchmarks.md).

Thin on purpose: the scenarios live in the repository's ``bench/`` package, which is not
installed with duetime (it starts processes, creates scratch databases and writes plots;
it is a development tool). This command finds it in the source checkout the package is
installed from (editable install, ``make install``) or in the current directory, and
says so in one line when neither has it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from scheduler.config import Settings
from scheduler.errors import InvalidInput

#: The checkout this package was imported from (editable install): <repo>/scheduler/cli.
CHECKOUT = Path(__file__).resolve().parents[2]


def _bench_module() -> Any:
    """``bench.cli`` from the checkout (or the current directory), imported on demand."""
    for root in (CHECKOUT, Path.cwd()):
        if (root / "bench" / "__init__.py").exists() and str(root) not in sys.path:
            sys.path.insert(0, str(root))
    try:
        return importlib.import_module("bench.cli")
    except ModuleNotFoundError as exc:
        if exc.name in ("bench", "bench.cli", "tests", "tests.support"):
            raise InvalidInput(
                "duetime bench runs from a source checkout (its bench/ package is not "
                f"installed): run it in the repository, e.g. `make bench` ({exc})"
            ) from None
        raise


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "bench",
        parents=[common],
        help="run benchmarks: storm, steady, recurring, scale, baseline, all",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    try:
        _bench_module().add_arguments(parser)
    except InvalidInput as exc:
        parser.add_argument("scenario", nargs="?", help=str(exc))
        parser.set_defaults(func=_unavailable, bench_error=str(exc))
        return
    parser.set_defaults(func=run)


def _unavailable(args: argparse.Namespace, settings: Settings) -> int:
    raise InvalidInput(args.bench_error)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    return int(await _bench_module().run(args, settings))
