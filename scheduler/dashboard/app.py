"""The dashboard's ASGI application: routes, the auth gate, security headers, errors.

One ``Dashboard`` object per process holds what every handler needs (settings, the
small pool, the stores, the auth keys, read-only mode, the templates); handlers live
in ``pages`` (GET) and ``actions`` (POST). The pool is the dashboard's own: at most
``POOL_MAX`` connections with a ``statement_timeout``, so an operator's browser can
never take the connections the scheduler and workers need, nor run a query for minutes.
``min_size=0`` lets the process start while PostgreSQL is down: pages then say so
(503) and recover by themselves when it is back.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import quote, unquote

import asyncpg
import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from scheduler import db
from scheduler.config import Settings
from scheduler.dashboard import actions, pages, present
from scheduler.dashboard.actions import FLASH_COOKIE
from scheduler.dashboard.auth import CSRF_COOKIE, SESSION_COOKIE, Auth
from scheduler.errors import DuetimeError, InvalidInput, InvalidTransition, JobNotFound
from scheduler.log import get_logger, scrub
from scheduler.planning import ScheduleNotFound
from scheduler.store import DashboardStore, JobStore, ScheduleStore

__all__ = ["POOL_MAX", "Dashboard", "create_app"]

log = get_logger(__name__)

POOL_MAX = 3
STATEMENT_TIMEOUT_MS = 5000
PUBLIC_PATHS = ("/healthz", "/login")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
DB_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


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


class Gate(BaseHTTPMiddleware):
    """Authentication, the CSRF cookie and security headers for every response."""

    def __init__(self, app: Any, dash: Dashboard) -> None:
        super().__init__(app)
        self.dash = dash

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        auth = self.dash.auth
        request.state.bearer = False
        cookie = request.cookies.get(CSRF_COOKIE)
        fresh_cookie = cookie is None
        request.state.csrf_cookie = cookie or auth.new_csrf_cookie()
        path = request.url.path
        public = path in PUBLIC_PATHS or path.startswith("/static/")
        if auth.required and not public:
            if auth.bearer_ok(request.headers.get("authorization")):
                request.state.bearer = True
            elif not auth.session_ok(request.cookies.get(SESSION_COOKIE)):
                response: Response
                if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                    target = path + (f"?{request.url.query}" if request.url.query else "")
                    response = RedirectResponse(
                        f"/login?next={quote(target, safe='')}", status_code=303
                    )
                else:
                    response = JSONResponse({"error": "authentication required"}, 401)
                    response.headers["WWW-Authenticate"] = 'Bearer realm="duetime"'
                return _harden(response)
        response = await call_next(request)
        if fresh_cookie:
            response.set_cookie(
                CSRF_COOKIE, request.state.csrf_cookie, path="/", httponly=True,
                samesite="strict", secure=request.url.scheme == "https",
            )  # fmt: skip
        return _harden(response)


def _harden(response: Response) -> Response:
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers.setdefault("Cache-Control", "no-store")
    return response


Handler = Callable[[Request], Awaitable[Response]]


def _errors(dash: Dashboard) -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    async def not_found(request: Request, exc: Exception) -> Response:
        return dash.render(request, "error.html", 404, title="Not found", message=str(exc))

    async def refused(request: Request, exc: Exception) -> Response:
        status = 409 if isinstance(exc, InvalidTransition) else 400
        return dash.render(request, "error.html", status, title="Refused", message=str(exc))

    async def unavailable(request: Request, exc: Exception) -> Response:
        text = scrub(f"{type(exc).__name__}: {exc}")[:500]
        log.warning("dashboard_database_error", path=request.url.path, error=text)
        return dash.render(
            request, "error.html", 503, title="PostgreSQL unavailable",
            message=f"The dashboard cannot read PostgreSQL right now ({text}). "
            "This page retries when reloaded.",
        )  # fmt: skip

    async def too_slow(request: Request, exc: Exception) -> Response:
        log.warning("dashboard_statement_timeout", path=request.url.path)
        return dash.render(
            request, "error.html", 503, title="Query too slow",
            message=f"This page's query ran longer than the dashboard's statement_timeout "
            f"({STATEMENT_TIMEOUT_MS // 1000} s) and was cancelled. Narrow the filter: "
            "a state or a due window uses an index.",
        )  # fmt: skip

    async def duetime_error(request: Request, exc: Exception) -> Response:
        return dash.render(request, "error.html", 400, title="Error", message=str(exc))

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        JobNotFound: not_found,
        ScheduleNotFound: not_found,
        InvalidInput: refused,
        InvalidTransition: refused,
        DuetimeError: duetime_error,
    }
    for error in DB_ERRORS:
        handlers[error] = unavailable
    handlers[asyncpg.QueryCanceledError] = too_slow  # more specific: Starlette takes the MRO
    return handlers


def create_app(dash: Dashboard) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await dash.open()
        try:
            yield
        finally:
            await dash.close()

    def bind(handler: Callable[[Dashboard, Request], Awaitable[Response]]) -> Handler:
        async def endpoint(request: Request) -> Response:
            return await handler(dash, request)

        return endpoint

    static = resources.files("scheduler.dashboard").joinpath("static")
    routes = [
        Route("/healthz", bind(pages.healthz)),
        Route("/login", bind(pages.login_form), methods=["GET"]),
        Route("/login", bind(actions.login), methods=["POST"]),
        Route("/logout", bind(actions.logout), methods=["POST"]),
        Route("/", bind(pages.overview)),
        Route("/jobs", bind(pages.jobs)),
        Route("/jobs/bulk", bind(pages.bulk_preview), methods=["GET"]),
        Route("/jobs/bulk", bind(actions.bulk), methods=["POST"]),
        Route("/jobs/{job_id:int}", bind(pages.job)),
        Route("/jobs/{job_id:int}/{action}", bind(actions.job_action), methods=["POST"]),
        Route("/schedules", bind(pages.schedules)),
        Route("/schedules/action", bind(actions.schedule_action), methods=["POST"]),
        Route("/schedules/{name:path}", bind(pages.schedule)),
        Route("/cluster", bind(pages.cluster)),
        Mount("/static", app=StaticFiles(directory=str(static)), name="static"),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(Gate, dash=dash)],
        exception_handlers=_errors(dash),
        lifespan=lifespan,
    )
