"""``duetime worker --import mod[,mod…] | --django SETTINGS --queue q[,q…] --concurrency N
[--threads N] [--processes N] [--grace-period S]``.

``--processes N`` runs N worker processes under this one command
(``scheduler.cli.worker_processes``).

The ``--import`` modules are the only code a worker loads: importing them runs their
``@task`` decorators, which fill the registry. Nothing named in a message is ever
imported. As with ``python -m``, the current directory is importable, so
``duetime worker --import myapp.tasks`` works from the application's checkout.

``--django mysite.settings`` sets Django up with those settings and registers the
tasks of the installed apps that use ``duetime.contrib.django.DuetimeBackend``
(``duetime.contrib.django.worker``); it may be given with ``--import`` or instead.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from typing import Any

import asyncpg

from scheduler import db
from scheduler.cli._util import SettingOverride, add_command, positive_int
from scheduler.cli.worker_processes import SUPERVISED_ENV, supervise
from scheduler.config import Settings
from scheduler.errors import DuetimeError, InvalidInput
from scheduler.jobspec import validate_queue
from scheduler.log import get_logger

log = get_logger(__name__)


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


HELP = "execute jobs from RabbitMQ queues"
DESCRIPTION = "Run registered tasks for jobs on the given queues until SIGTERM."


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = add_command(sub, common, "worker", HELP, DESCRIPTION)
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE[,MODULE…]",
        help="module(s) whose @task functions this worker runs (repeatable)",
    )
    parser.add_argument(
        "--django",
        metavar="SETTINGS_MODULE",
        help="run the Django project's tasks (django.tasks with DuetimeBackend) of its "
        "installed apps, with these settings",
    )
    parser.add_argument(
        "--queue",
        dest="queues",
        action="append",
        metavar="QUEUE[,QUEUE…]",
        help="job queue(s) to consume (repeatable; default: default)",
    )
    parser.add_argument(
        "--concurrency",
        dest="worker_concurrency",
        type=positive_int,
        action=SettingOverride,
        default=argparse.SUPPRESS,
        metavar="N",
        help="handlers run at once; prefetch is 3x (env DUETIME_WORKER_CONCURRENCY; default 16)",
    )
    parser.add_argument(
        "--threads",
        dest="worker_threads",
        type=positive_int,
        action=SettingOverride,
        default=argparse.SUPPRESS,
        metavar="N",
        help="threads for plain def handlers (env DUETIME_WORKER_THREADS; default: concurrency)",
    )
    parser.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        metavar="N",
        help="run N worker processes under this command, restarted when they die "
        "(for CPU-bound handlers; default 1)",
    )
    parser.add_argument(
        "--grace-period",
        dest="worker_grace_period",
        action=SettingOverride,
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help="seconds running handlers get after SIGTERM (env DUETIME_WORKER_GRACE_PERIOD)",
    )
    parser.set_defaults(func=run)


def import_task_modules(modules: list[str]) -> None:
    """Import each module; a missing or failing module is one clear error line."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    for name in modules:
        try:
            importlib.import_module(name)
        except InvalidInput:
            raise  # e.g. a task name registered twice: its message says where
        except ModuleNotFoundError as exc:
            raise InvalidInput(f"--import {name}: {exc} (is it on PYTHONPATH?)") from None
        except Exception as exc:
            raise InvalidInput(f"--import {name} failed: {type(exc).__name__}: {exc}") from exc


async def run(args: argparse.Namespace, settings: Settings) -> int:
    from workers.registry import default_registry
    from workers.worker import run_worker

    modules = [m for raw in args.imports or [] for m in _csv(raw)]
    queues = [validate_queue(q) for raw in (args.queues or ["default"]) for q in _csv(raw)]
    if args.imports is None and args.django is None:
        raise InvalidInput("worker needs --import MODULE or --django SETTINGS_MODULE")
    if args.imports is not None and not modules:
        raise InvalidInput("--import needs at least one module name")
    if not queues:
        raise InvalidInput("--queue needs at least one queue name")
    if args.django is not None:
        # the one place duetime loads Django: only when asked, and only here
        try:
            from duetime.contrib.django.worker import load_tasks
        except ImportError as exc:  # no Django, or one without django.tasks
            raise InvalidInput(f"--django: {exc}") from None

        names = load_tasks(args.django, default_registry)
        log.info("django_tasks_registered", settings=args.django, tasks=names)
    import_task_modules(modules)
    if not len(default_registry):
        raise InvalidInput(
            f"--import {','.join(modules)} registered no tasks (use @workers.task(...))"
        )
    await warn_undeclared(settings, queues)
    if args.processes > 1 and SUPERVISED_ENV not in os.environ:
        # the modules imported above proved the command line; each child imports them again
        return await supervise(args.processes, settings)
    return await run_worker(settings, queues=queues, registry=default_registry)


async def warn_undeclared(settings: Settings, queues: list[str], timeout: float = 5.0) -> None:
    """Say at start which ``--queue`` names are not declared (``duetime queues add``):
    the dispatcher holds their jobs, so this worker would wait for nothing. A warning, not
    an error (the operator may declare it next); skipped quietly when the database does
    not answer within ``timeout`` (the worker's own start retries it)."""
    from scheduler.store.queues import QueueStore

    missing: set[str] = set()
    for shard, url in settings.shard_urls.items():
        try:
            async with asyncio.timeout(timeout):
                pool = await db.create_pool(url, max_size=1, timeout=timeout)
                try:
                    store = QueueStore(pool, acquire_timeout=timeout)
                    missing |= {q for q in queues if not await store.declared(q)}
                finally:
                    await pool.close()
        except (OSError, TimeoutError, asyncpg.PostgresError, DuetimeError) as exc:
            log.debug("queue_check_skipped", shard=shard, error=f"{type(exc).__name__}: {exc}")
    for queue in sorted(missing):
        log.warning(
            "queue_undeclared",
            queue=queue,
            detail="its jobs are held, not dispatched, until `duetime queues add` declares it",
        )
        print(
            f"duetime: warning: queue {queue} is not declared: its jobs are held and this "
            f"worker gets none of them until `duetime queues add {queue}`",
            file=sys.stderr,
        )
