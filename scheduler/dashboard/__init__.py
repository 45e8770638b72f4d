"""``duetime dashboard``: the operations page (DESIGN §9).

Server-rendered HTML (Starlette + Jinja2, autoescaped), live updates by htmx polling
(vendored in ``static/``, pinned), charts as inline SVG drawn on the server: no
JavaScript build. It reads through ``DashboardStore``/``StatusStore`` and acts only
through ``JobStore``/``ScheduleStore``, the CLI's own transitions.

Modules: ``app`` (routes, auth gate, errors), ``site`` (the object handlers receive: a
small pool per shard, the request's shard, rendering), ``auth`` (token, session cookie,
CSRF, loopback rule), ``pages`` (GET), ``actions`` (POST), ``present`` and ``charts``
(pure), ``cluster`` (etcd and RabbitMQ views), ``shards`` (every shard's status for the
overview), ``server`` (uvicorn on our loop, graceful SIGTERM).
"""

from scheduler.dashboard.app import create_app
from scheduler.dashboard.site import Dashboard

__all__ = ["Dashboard", "create_app"]
