"""The dashboard's ASGI application: routes, the auth gate, security headers, errors.

One ``Dashboard`` object per process (``scheduler.dashboard.site``) holds what every
handler needs; handlers live in ``pages`` (GET) and ``actions`` (POST); this module
wires them to routes behind the auth gate.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any
from urllib.parse import quote

import asyncpg
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from scheduler.dashboard import actions, pages
from scheduler.dashboard.auth import CSRF_COOKIE, SESSION_COOKIE
from scheduler.dashboard.site import DB_ERRORS, STATEMENT_TIMEOUT_MS, Dashboard, UnknownShard
from scheduler.errors import DuetimeError, InvalidInput, InvalidTransition, JobNotFound
from scheduler.log import get_logger, scrub
from scheduler.planning import ScheduleNotFound

__all__ = ["Dashboard", "create_app"]

log = get_logger(__name__)

PUBLIC_PATHS = ("/healthz", "/login")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


class Gate(BaseHTTPMiddleware):
    """Host check, authentication, the CSRF binding and security headers for every
    response."""

    def __init__(self, app: Any, dash: Dashboard) -> None:
        super().__init__(app)
        self.dash = dash

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        auth = self.dash.auth
        host = request.headers.get("host")
        if not self.dash.allowed_hosts.allows(host):
            log.warning(
                "dashboard_host_refused", host=(host or "")[:100], client=actions.client_of(request)
            )
            return _harden(
                PlainTextResponse(
                    "this dashboard does not answer to that host name (Host header); "
                    "add it to DUETIME_DASHBOARD_HOSTS if it is yours",
                    status_code=421,
                )
            )
        request.state.bearer = False
        cookie = request.cookies.get(CSRF_COOKIE)
        fresh_cookie = cookie is None
        request.state.csrf_cookie = cookie or auth.new_csrf_cookie()
        session = request.cookies.get(SESSION_COOKIE)
        request.state.session = session if auth.session_ok(session) else None
        request.state.csrf_binding = (
            f"session:{session}" if request.state.session else f"cookie:{request.state.csrf_cookie}"
        )
        path = request.url.path
        public = path in PUBLIC_PATHS or path.startswith("/static/")
        if auth.required and not public:
            offered = auth.bearer(request.headers.get("authorization"))
            if offered is not None:
                verdict = auth.try_token(offered, actions.client_of(request), via="bearer")
                if verdict.retry_after:
                    return _harden(_throttled(verdict.retry_after))
                if not verdict.ok:
                    return _harden(_unauthenticated())
                request.state.bearer = True
            elif request.state.session is None:
                response: Response
                if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                    target = path + (f"?{request.url.query}" if request.url.query else "")
                    response = RedirectResponse(
                        f"/login?next={quote(target, safe='')}", status_code=303
                    )
                else:
                    response = _unauthenticated()
                return _harden(response)
        response = await call_next(request)
        if fresh_cookie:
            response.set_cookie(
                CSRF_COOKIE, request.state.csrf_cookie, path="/", httponly=True,
                samesite="strict", secure=request.url.scheme == "https",
            )  # fmt: skip
        return _harden(response)


def _unauthenticated() -> Response:
    response = JSONResponse({"error": "authentication required"}, 401)
    response.headers["WWW-Authenticate"] = 'Bearer realm="duetime"'
    return response


def _throttled(retry_after: float) -> Response:
    seconds = max(1, math.ceil(retry_after))
    response = JSONResponse(
        {"error": f"too many wrong tokens from this address: retry in {seconds} s"}, 429
    )
    response.headers["Retry-After"] = str(seconds)
    return response


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

    async def forbidden(request: Request, exc: Exception) -> Response:
        # The dashboard's login lacks a privilege (a grant missing or revoked): the
        # database is up, so this is no outage to retry but a setup to fix.
        text = scrub(str(exc))[:500]
        log.warning("dashboard_permission_denied", path=request.url.path, error=text)
        response = dash.render(
            request, "error.html", 403, title="Permission denied",
            message=f"permission denied: {text}. The dashboard's PostgreSQL login "
            "lacks a privilege this page needs (see docs/security.md, roles).",
        )  # fmt: skip
        return _harden(response)

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

    async def internal(request: Request, exc: Exception) -> Response:
        # Starlette answers unhandled errors outside every middleware, the Gate's
        # security headers included: this page adds them itself, and names no detail
        # (the traceback goes to the log, scrubbed of secrets).
        log.error(
            "dashboard_internal_error",
            path=request.url.path,
            error=scrub(f"{type(exc).__name__}: {exc}")[:500],
            exc_info=exc,
        )
        response: Response
        try:
            response = dash.render(
                request, "error.html", 500, title="Internal error",
                message="The dashboard failed to build this page; the details are in its log.",
            )  # fmt: skip
        except Exception:  # the page itself could not be built (no request state, say)
            response = PlainTextResponse("Internal error: the details are in the log.", 500)
        return _harden(response)

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        Exception: internal,
        JobNotFound: not_found,
        ScheduleNotFound: not_found,
        UnknownShard: not_found,
        InvalidInput: refused,
        InvalidTransition: refused,
        DuetimeError: duetime_error,
    }
    for error in DB_ERRORS:
        handlers[error] = unavailable
    handlers[asyncpg.QueryCanceledError] = too_slow  # more specific: Starlette takes the MRO
    handlers[asyncpg.InsufficientPrivilegeError] = forbidden
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
        Route("/workflows/{workflow_id:int}", bind(pages.workflow)),
        Route(
            "/workflows/{workflow_id:int}/cancel", bind(actions.workflow_cancel), methods=["POST"]
        ),
        Route("/schedules", bind(pages.schedules)),
        Route("/schedules/action", bind(actions.schedule_action), methods=["POST"]),
        Route("/schedules/{name:path}", bind(pages.schedule)),
        Route("/limits", bind(pages.limits)),
        Route("/cluster", bind(pages.cluster)),
        Mount("/static", app=StaticFiles(directory=str(static)), name="static"),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(Gate, dash=dash)],
        exception_handlers=_errors(dash),
        lifespan=lifespan,
    )
