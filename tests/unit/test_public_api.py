"""The public API cannot drift: every exported name resolves, ``duetime`` exports exactly
what ``scheduler`` and ``workers`` export (the same objects), and the package roots stay
cheap to import (``import scheduler.cron`` must not load asyncpg and the stores)."""

from __future__ import annotations

import subprocess
import sys

import duetime
import scheduler
import workers


def test_every_exported_name_resolves() -> None:
    for package in (scheduler, workers, duetime):
        for name in package.__all__:
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"
        assert package.__all__ == sorted(package.__all__)


def test_duetime_is_exactly_the_two_roots() -> None:
    assert set(duetime.__all__) == set(scheduler.__all__) | set(workers.__all__)
    assert not set(scheduler.__all__) & set(workers.__all__)
    for name in duetime.__all__:
        home = scheduler if name in scheduler.__all__ else workers
        assert getattr(duetime, name) is getattr(home, name), name


def test_unknown_names_raise_attribute_error() -> None:
    name = "no_such_name"
    for package in (scheduler, duetime):
        try:
            getattr(package, name)
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        else:
            raise AssertionError(f"{package.__name__}.no_such_name resolved")


def test_importing_the_roots_loads_nothing_heavy() -> None:
    code = (
        "import sys, duetime, scheduler, scheduler.cron\n"
        "heavy = sorted(m for m in ('asyncpg', 'aio_pika', 'scheduler.store', 'workers')"
        " if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""


def test_the_lazy_map_is_the_export_list() -> None:
    assert sorted(scheduler._EXPORTS) == scheduler.__all__


def test_duetime_testing_is_the_workers_helper() -> None:
    import duetime.testing
    import workers.testing

    assert duetime.testing.__all__ == [
        "DrainReport",
        "drain",
        "drain_async",
        "make_context",
        "run_task",
    ]
    for name in duetime.testing.__all__:
        assert getattr(duetime.testing, name) is getattr(workers.testing, name), name


def test_a_producer_routes_through_the_exported_router() -> None:
    from scheduler.shards.router import RoutedJob, ShardRouter

    assert duetime.ShardRouter is ShardRouter
    assert duetime.RoutedJob is RoutedJob


def test_importing_duetime_and_its_enqueue_loads_no_optional_driver() -> None:
    """psycopg, SQLAlchemy and Django are optional extras: neither ``import duetime``
    nor resolving ``duetime.enqueue`` (nor the worker package) may import them; only a
    call given one of their connections touches them (and Django's default connection
    is imported only when none is given). OpenTelemetry likewise: ``scheduler.tracing``
    uses it only when the application imported it, so planning an enqueue (which asks
    for the active span), the publisher, the worker and ``duetime.testing`` load none of
    it although the dev extra installs it."""
    code = (
        "import sys, duetime, workers.worker\n"
        "duetime.enqueue, duetime.bulk_enqueue, duetime.enqueue_async, duetime.Worker\n"
        "import scheduler.cli, scheduler.publisher, scheduler.tracing, duetime.testing\n"
        "import scheduler.cli.worker_cmd, duetime.contrib\n"
        "from datetime import UTC, datetime\n"
        "from scheduler.store.jobs import copy_lines, plan_enqueue\n"
        "from scheduler.jobspec import JobSpec\n"
        "assert plan_enqueue('t', {}, now=datetime.now(UTC)).args[-1] is None\n"
        "copy_lines([JobSpec('t')], datetime.now(UTC))\n"
        "assert scheduler.tracing.tracer() is None\n"
        "optional = sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('psycopg', 'psycopg2', 'sqlalchemy', 'django', 'opentelemetry'))\n"
        "print(','.join(optional))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""


def test_the_django_tasks_backend_says_which_django_it_needs() -> None:
    """``duetime.contrib.django`` needs ``django.tasks`` (Django >= 6.0, Python >= 3.12);
    with an older Django (this venv's 5.2, which ``duetime.enqueue`` supports) importing
    it says so instead of failing on a missing module. tests/integration/
    test_django_tasks.py runs it on Django 6."""
    code = (
        "import django\n"
        "try:\n"
        "    import duetime.contrib.django\n"
        "except ImportError as exc:\n"
        "    print('refused', django.VERSION[0], exc)\n"
        "else:\n"
        "    print('loaded', django.VERSION[0], duetime.contrib.django.DuetimeBackend.__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    verdict, major, *rest = out.split(" ", 2)
    if int(major) < 6:
        assert verdict == "refused" and "needs Django >= 6.0" in rest[0], out
    else:
        assert out.endswith("DuetimeBackend"), out


def test_duetime_workflow_is_the_scheduler_builder() -> None:
    import duetime.workflow
    import scheduler.workflow

    for name in duetime.workflow.__all__:
        assert getattr(duetime.workflow, name) is getattr(scheduler.workflow, name), name
    assert duetime.Workflow is scheduler.workflow.Workflow
