"""The one object every dashboard handler receives: settings, the dashboard's own small
pool and the stores on it, the auth keys, read-only mode and the templates.

It lives apart from ``app`` (routes, middleware) so the handler modules ``pages`` and
``actions`` can name it without importing the application that imports them. The pool
is the dashboard's own: at most ``POOL_MAX`` connections with a ``statement_timeout``,
so an operator's browser can never take the connections the scheduler and workers need,
nor run a query for minutes. ``min_size=0`` lets the process start while PostgreSQL is
down: pages then say so (503) and recover by themselves when it is back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import quote, unquote

import asyncpg
import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from scheduler import db
from scheduler.config import Settings
from scheduler.dashboard import present
from scheduler.dashboard.auth import Auth
from scheduler.store import DashboardStore, JobStore, ScheduleStore

__all__ = ["FLASH_COOKIE", "POOL_MAX", "STATEMENT_TIMEOUT_MS", "Dashboard"]

POOL_MAX = 3
STATEMENT_TIMEOUT_MS = 5000
#: A one-shot message for the next page (set by an action's redirect, shown once).
FLASH_COOKIE = "duetime_flash"


def _templates() -> jinja2.Environment:
    folder = resources.files("scheduler.dashboard").joinpath("templates")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(folder)),
        autoescape=True,  # every page shows attacker-controlled payloads, tasks, errors
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        age=present.age,
        seconds=present.seconds,
        utc=present.utc,
        quote=lambda text: quote(str(text), safe=""),
    )
    return env


@dataclass
class Dashboard:
    settings: Settings
    auth: Auth
    read_only: bool = False
    templates: jinja2.Environment = field(default_factory=_templates)
    pool: asyncpg.Pool | None = None

    @property
    def jobs(self) -> JobStore:
        assert self.pool is not None
        return JobStore(self.pool)

    @property
    def schedules(self) -> ScheduleStore:
        assert self.pool is not None
        return ScheduleStore(self.pool)

    @property
    def views(self) -> DashboardStore:
        assert self.pool is not None
        return DashboardStore(self.pool)

    async def open(self) -> None:
        self.pool = await db.create_pool(
            self.settings.database_url,
            min_size=0,
            max_size=POOL_MAX,
            timeout=self.settings.db_timeout,
            application_name="duetime-dashboard",
            server_settings={
                "statement_timeout": str(STATEMENT_TIMEOUT_MS),
                "idle_in_transaction_session_timeout": str(STATEMENT_TIMEOUT_MS * 2),
            },
        )

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    def render(
        self, request: Request, template: str, status_code: int = 200, **context: Any
    ) -> HTMLResponse:
        flash = request.cookies.get(FLASH_COOKIE)
        html = self.templates.get_template(template).render(
            request=request,
            read_only=self.read_only,
            auth_required=self.auth.required,
            csrf=self.auth.csrf_token(request.state.csrf_cookie),
            flash=unquote(flash)[:500] if flash else None,
            nav=request.url.path,
            **context,
        )
        response = HTMLResponse(html, status_code=status_code)
        if flash:
            response.delete_cookie(FLASH_COOKIE, path="/")
        return response
