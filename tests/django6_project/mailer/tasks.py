"""The app's tasks: what ``duetime worker --django`` registers (module paths)."""

from __future__ import annotations

from typing import Any

from django.tasks import task

from .models import Receipt


class MailerError(Exception):
    """What ``fail`` raises: its path is what the result's error names."""


@task
def add(a: int, b: int) -> dict[str, Any]:
    return {"sum": a + b}


@task
def fail(message: str) -> None:
    raise MailerError(message)


@task(takes_context=True)
def attempt(context: Any) -> list[Any]:
    return [context.task_result.id, context.attempt]


@task
def send_receipt(email: str) -> int:
    """Writes through the Django ORM on the worker's handler thread."""
    return int(Receipt.objects.create(email=email).id)
