"""The producer's side of the end-to-end run (tests/integration/test_django_tasks.py):
with a real scheduler and ``duetime worker --django`` running, enqueue the app's tasks
on queue ``$DJANGO6_QUEUE``, ``refresh()`` each result until it finished, and
print what Django's API says about each as one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import django


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django6_project.settings")
    django.setup()
    from django.db import connection, transaction

    import duetime
    from scheduler.store import sync_jobs
    from tests.django6_project.mailer import tasks

    queue = os.environ["DJANGO6_QUEUE"]
    with transaction.atomic():
        results = {
            "add": tasks.add.using(queue_name=queue).enqueue(2, b=40),
            "fail": tasks.fail.using(queue_name=queue).enqueue("no mail today"),
            "attempt": tasks.attempt.using(queue_name=queue).enqueue(),
            "send_receipt": tasks.send_receipt.using(queue_name=queue).enqueue("c@example.com"),
        }
        # a message naming code outside the installed apps (as a forged one would)
        stray = duetime.enqueue(
            connection,
            "tests.django6_project.outside.stray",
            {"args": [], "kwargs": {}},
            queue=queue,
            max_attempts=1,
        )
    deadline = time.monotonic() + float(os.environ.get("DJANGO6_WAIT", "60"))
    while time.monotonic() < deadline:
        stray = sync_jobs.get(connection, stray.id) or stray
        if all(r.is_finished for r in results.values()) and stray.finished_at is not None:
            break
        time.sleep(0.2)
        for result in results.values():
            result.refresh()
    report: dict[str, Any] = {}
    for name, result in results.items():
        entry: dict[str, Any] = {"id": result.id, "status": str(result.status)}
        if result.status == "SUCCESSFUL":
            entry["return_value"] = result.return_value
        entry["errors"] = [e.exception_class_path for e in result.errors]
        entry["tracebacks"] = [e.traceback for e in result.errors]
        entry["attempts"] = result.attempts
        entry["finished"] = result.finished_at is not None
        report[name] = entry
    report["stray"] = {"status": stray.status, "last_error": stray.last_error}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
