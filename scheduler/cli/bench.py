"""``duetime bench SCENARIO [--quick]``: the benchmarks (docs/benchmarks.md).

Thin on purpose: the scenarios live in the repository's ``bench/`` package, which is not
installed with duetime (it starts processes, creates scratch databases and writes plots;
it is a development tool). Two rules keep it from being a way to run foreign code:

- it is imported only when the command *is* ``duetime bench`` (the sub-parser fills its
  arguments when it is about to parse them), never while another command builds its
  parser, so ``duetime worker`` or ``duetime scheduler`` import no benchmark code;
- it is imported only from the checkout the ``scheduler`` package itself was loaded
  from (editable install, ``make install``), never from the current directory: a
  ``bench/`` directory where a service happens to run is not code duetime loads.

Without that checkout (an installed wheel) the command says so in one line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from scheduler.cli._util import add_command
from scheduler.config import Settings
from scheduler.errors import InvalidInput

#: The checkout this package was imported from (editable install): <repo>/scheduler/cli.
CHECKOUT = Path(__file__).resolve().parents[2]


def _is_cwd(entry: str) -> bool:
    """A ``sys.path`` entry naming the current directory, however it is spelled
    (``python -m`` puts ``''`` first)."""
    if entry in ("", "."):
        return True
    try:
        return Path(entry).resolve() == Path(os.getcwd()).resolve()
    except OSError:
        return False


def _bench_module() -> Any:
    """``bench.cli`` from the checkout, imported on demand; never from the current
    directory (``bench`` and the ``tests.support`` it uses resolve in the checkout)."""
    unavailable = InvalidInput(
        "duetime bench runs from a source checkout (its bench/ package is not installed): "
        f"run it from an editable install of the repository, e.g. `make bench` "
        f"(no {CHECKOUT / 'bench'})"
    )
    if not (CHECKOUT / "bench" / "__init__.py").is_file():
        raise unavailable
    root = str(CHECKOUT)
    sys.path[:] = [root, *(p for p in sys.path if p != root and not _is_cwd(p))]
    loaded = sys.modules.get("bench")
    if loaded is not None and not _inside_checkout(loaded):
        raise InvalidInput(f"a module named bench is already loaded from {loaded.__file__}")
    try:
        module = importlib.import_module("bench.cli")
    except ModuleNotFoundError as exc:
        if exc.name in ("bench", "bench.cli", "tests", "tests.support"):
            raise unavailable from None
        raise
    if not _inside_checkout(module):
        raise InvalidInput(f"bench.cli was found at {module.__file__}, outside {CHECKOUT}")
    return module


def _inside_checkout(module: Any) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and Path(path).resolve().is_relative_to(CHECKOUT / "bench")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        _bench_module().add_arguments(parser)
    except InvalidInput as exc:
        parser.add_argument("scenario", nargs="?", help=str(exc))
        parser.set_defaults(func=_unavailable, bench_error=str(exc))


HELP = "run benchmarks: storm, steady, recurring, scale, baseline, shards, shardsim, all"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = add_command(sub, common, "bench", HELP, __doc__)
    parser.set_defaults(func=run)
    # filled only when this sub-command is the one being parsed (scheduler.cli.Parser)
    parser.add_arguments_later = _add_arguments


def _unavailable(args: argparse.Namespace, settings: Settings) -> int:
    raise InvalidInput(args.bench_error)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    return int(await _bench_module().run(args, settings))
