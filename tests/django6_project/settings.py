"""Settings of the Django 6 test project (the Tasks backend, duetime.contrib.django): the
database comes from ``DJANGO6_DATABASE_URL`` (not a ``DUETIME_`` name: the worker
refuses unknown ones) (Django's test runner creates
``test_<name>`` from it and drops it after; the end-to-end run uses it as it is)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

_url = urlsplit(os.environ["DJANGO6_DATABASE_URL"])

SECRET_KEY = "duetime-test-only"
USE_TZ = True
INSTALLED_APPS = ["tests.django6_project.mailer"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "postgres",
        "PASSWORD": _url.password or "",
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": _url.port or 5432,
    }
}
TASKS = {
    "default": {
        "BACKEND": "duetime.contrib.django.DuetimeBackend",
        "QUEUES": [],  # any queue duetime accepts
        "OPTIONS": {"MAX_ATTEMPTS": 1},  # a failing task is FAILED at once
    }
}
