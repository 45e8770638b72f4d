"""A task outside the installed apps: enqueueing it is refused, no worker registers it."""

from __future__ import annotations

from django.tasks import task


@task
def stray() -> str:
    return "must never run"
