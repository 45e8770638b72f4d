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
    from django.db import transaction

    from tests.django6_project.mailer import tasks

    queue = os.environ["DJANGO6_QUEUE"]
    with transaction.atomic():
        results = {
            "add": tasks.add.using(queue_name=queue).enqueue(2, b=40),
            "fail": tasks.fail.using(queue_name=queue).enqueue("no mail today"),
            "attempt": tasks.attempt.using(queue_name=queue).enqueue(),
            "send_receipt": tasks.send_receipt.using(queue_name=queue).enqueue("c@example.com"),
        }
    deadline = time.monotonic() + float(os.environ.get("DJANGO6_WAIT", "60"))
    while not all(r.is_finished for r in results.values()) and time.monotonic() < deadline:
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
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
