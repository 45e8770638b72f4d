"""Settings of the test project: the database comes from ``DUETIME_DJANGO_DATABASE_URL``
(Django's test runner creates ``test_<name>`` from it, and drops it after)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

_url = urlsplit(os.environ["DUETIME_DJANGO_DATABASE_URL"])

SECRET_KEY = "duetime-test-only"
USE_TZ = True
INSTALLED_APPS = ["tests.django_project.shop"]
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
