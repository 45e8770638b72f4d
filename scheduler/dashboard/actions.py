"""The dashboard's actions (POST): each checks read-only mode and CSRF first, then calls
the one store method the CLI uses for the same thing, and redirects (303) back with a
one-shot message. No transition is written here.

Refusals: read-only → 403; a missing or wrong CSRF token, or an ``Origin`` that is not
a host the dashboard answers to → 403; a transition the state does not allow → the
store's reason, shown. Every action and refusal is logged with the client's address:
the audit trail.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from datetime import datetime
from urllib.parse import quote

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

from scheduler.dashboard.auth import CSRF_COOKIE, SESSION_COOKIE, SESSION_TTL, local_path
from scheduler.dashboard.pages import filter_fields, parse_filter
from scheduler.dashboard.site import FLASH_COOKIE, Dashboard
from scheduler.errors import InvalidInput
from scheduler.log import get_logger
from scheduler.store import BulkPreview

log = get_logger(__name__)

JOB_ACTIONS = ("retry", "cancel", "run-now")
SCHEDULE_ACTIONS = ("pause", "resume", "trigger")


def redirect(url: str, message: str | None = None) -> RedirectResponse:
    """303 after a POST, with a one-shot message shown by the next page."""
    response = RedirectResponse(url, status_code=303)
    if message:
        response.set_cookie(
            FLASH_COOKIE, quote(message[:500]), max_age=60, path="/", httponly=True,
            samesite="strict",
        )  # fmt: skip
    return response


def client_of(request: Request) -> str:
    """The client's address: the connection's peer, or the proxy's X-Forwarded-For when
    DUETIME_DASHBOARD_TRUSTED_PROXIES names the proxy (uvicorn applies it)."""
    return request.client.host if request.client else "unknown"


class Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _same_origin(dash: Dashboard, request: Request) -> bool:
    """The POST's ``Origin`` names a host the dashboard answers to (not merely the
    ``Host`` it was sent with: under DNS rebinding the two agree)."""
    origin = request.headers.get("origin")
    if origin is None:  # same-origin form posts from older browsers, API clients
        return True
    return dash.allowed_hosts.allows_origin(origin)


async def checked_form(dash: Dashboard, request: Request, *, action: bool = True) -> FormData:
    """The POST's form once read-only mode, Origin and CSRF allow it; else ``Refused``."""
    if action and dash.read_only:
        raise Refused(403, "the dashboard is read-only (--read-only): actions are disabled")
    form = await request.form()
    if request.state.bearer:
        return form  # not an ambient credential: a cross-site page cannot send it
    if not _same_origin(dash, request):
        raise Refused(403, "cross-origin request refused")
    offered = form.get("csrf") or request.headers.get("x-csrf-token")
    # logged in: bound to the session; else to the duetime_csrf cookie the browser sent
    binding = request.state.csrf_binding
    if request.state.session is None and CSRF_COOKIE not in request.cookies:
        binding = None
    if not dash.auth.csrf_ok(binding, offered if isinstance(offered, str) else None):
        raise Refused(403, "missing or invalid CSRF token: reload the page and try again")
    return form


def _refused(request: Request, exc: Refused) -> Response:
    log.warning(
        "dashboard_action_refused", path=request.url.path, reason=exc.reason,
        client=client_of(request),
    )  # fmt: skip
    return PlainTextResponse(exc.reason, status_code=exc.status)


Endpoint = Callable[[Dashboard, Request], Awaitable[Response]]
FormHandler = Callable[[Dashboard, Request, FormData], Awaitable[Response]]


def posted(*, action: bool = True) -> Callable[[FormHandler], Endpoint]:
    """An endpoint that runs its handler only on a form ``checked_form`` lets through
    (``action``: refused in read-only mode too); a refusal is logged and answered with
    its status, and the handler never sees it."""

    def wrap(handler: FormHandler) -> Endpoint:
        @functools.wraps(handler)
        async def endpoint(dash: Dashboard, request: Request) -> Response:
            try:
                form = await checked_form(dash, request, action=action)
            except Refused as exc:
                return _refused(request, exc)
            return await handler(dash, request, form)

        return endpoint

    return wrap


async def login(dash: Dashboard, request: Request) -> Response:
    if not dash.auth.required:
        return redirect("/")
    try:
        form = await checked_form(dash, request, action=False)
    except Refused as exc:
        return _refused(request, exc)
    target = local_path(str(form.get("next") or "/"))
    client = client_of(request)
    verdict = dash.auth.try_token(str(form.get("token") or ""), client, via="login")
    if verdict.retry_after:
        seconds = max(1, math.ceil(verdict.retry_after))
        page = dash.render(request, "login.html", 429, next=target, wait=seconds)
        page.headers["Retry-After"] = str(seconds)
        return page
    if not verdict.ok:
        log.warning("dashboard_login_failed", client=client)
        return dash.render(request, "login.html", 401, next=target, failed=True)
    dash.auth.end_session(request.state.session)
    response = redirect(target)
    response.set_cookie(
        SESSION_COOKIE, dash.auth.new_session(), max_age=int(SESSION_TTL), path="/",
        httponly=True, samesite="strict", secure=request.url.scheme == "https",
    )  # fmt: skip
    return response


@posted(action=False)
async def logout(dash: Dashboard, request: Request, form: FormData) -> Response:
    if dash.auth.end_session(request.state.session):
        log.info("dashboard_logout", client=client_of(request))
    response = redirect("/login" if dash.auth.required else "/")
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


@posted()
async def job_action(dash: Dashboard, request: Request, form: FormData) -> Response:
    job_id = request.path_params["job_id"]
    action = request.path_params["action"]
    if action not in JOB_ACTIONS:
        return PlainTextResponse(f"unknown action {action!r}", status_code=404)
    site = dash.site(request, form)
    store = site.jobs
    if action == "retry":
        job = await store.retry(job_id)
    elif action == "cancel":
        job = await store.cancel(job_id, by=f"dashboard:{client_of(request)}")
    else:
        job = await store.run_now(job_id)
    log.info(
        "dashboard_job_action", action=action, job_id=job_id, status=job.status,
        shard=site.name, client=client_of(request),
    )  # fmt: skip
    return redirect(site.url(f"/jobs/{job_id}"), f"{action}: job {job_id} is now {job.status}")


@posted()
async def workflow_cancel(dash: Dashboard, request: Request, form: FormData) -> Response:
    """Cancel every unfinished job of a workflow (``JobStore.cancel_workflow``: one
    transaction; running handlers are told at its commit)."""
    workflow_id = request.path_params["workflow_id"]
    site = dash.site(request, form)
    changed = await site.jobs.cancel_workflow(workflow_id, by=f"dashboard:{client_of(request)}")
    log.info(
        "dashboard_workflow_cancel", workflow_id=workflow_id, changed=changed,
        shard=site.name, client=client_of(request),
    )  # fmt: skip
    return redirect(
        site.url(f"/workflows/{workflow_id}"),
        f"cancel: {changed} unfinished job(s) of workflow {workflow_id} cancelled",
    )


@posted()
async def bulk(dash: Dashboard, request: Request, form: FormData) -> Response:
    site = dash.site(request, form)
    fields = {k: str(v) for k, v in form.items() if isinstance(v, str)}
    where = parse_filter(fields)
    action = fields.get("action", "")
    preview = _confirmed_preview(action, fields)
    if action == "cancel":
        changed = await site.jobs.cancel_matching(
            where, preview=preview, by=f"dashboard:{client_of(request)}"
        )
    elif action == "retry":
        changed = await site.jobs.retry_matching(where, preview=preview)
    else:
        raise InvalidInput(f"unknown bulk action {action!r}")
    log.info(
        "dashboard_bulk_action", action=action, changed=changed, previewed=preview.count,
        up_to_id=preview.up_to_id, filter=filter_fields(fields), shard=site.name,
        client=client_of(request),
    )  # fmt: skip
    return redirect(
        site.url("/jobs", **filter_fields(fields)),
        f"{action}: {changed} of {preview.count} previewed job(s) changed",
    )


def _confirmed_preview(action: str, fields: dict[str, str]) -> BulkPreview:
    """The set the preview page pinned (up_to_id, count, as_of), from its hidden fields."""
    up_to, count, as_of = (fields.get(k, "") for k in ("up_to_id", "count", "as_of"))
    if not (up_to.isdigit() and count.isdigit()):
        raise InvalidInput("up_to_id/count are missing: confirm from the preview page")
    try:
        pinned = datetime.fromisoformat(as_of) if as_of else None
    except ValueError:
        raise InvalidInput("as_of is not a time: confirm from the preview page") from None
    if action == "retry" and pinned is None:
        raise InvalidInput("as_of is missing: confirm from the preview page")
    return BulkPreview(action, int(count), int(up_to), pinned)


@posted()
async def schedule_action(dash: Dashboard, request: Request, form: FormData) -> Response:
    name = str(form.get("name") or "")
    action = str(form.get("action") or "")
    if action not in SCHEDULE_ACTIONS:
        raise InvalidInput(f"unknown schedule action {action!r}")
    site = dash.site(request, form)
    store = site.schedules
    if action == "pause":
        schedule, cancelled = await store.pause(name)
        message = f"paused {schedule.name}; {cancelled} planned job(s) cancelled"
    elif action == "resume":
        schedule = await store.resume(name)
        message = f"resumed {schedule.name}; it fires again from now"
    else:
        job = await store.trigger(name)
        message = f"triggered {name}: job {job.id} due now"
    log.info(
        "dashboard_schedule_action", action=action, schedule=name, shard=site.name,
        client=client_of(request),
    )  # fmt: skip
    return redirect(site.url(f"/schedules/{quote(name, safe='')}"), message)
