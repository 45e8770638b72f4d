"""The dashboard's pages (GET): each reads through the stores and renders one template.

Filters arrive as query parameters (DESIGN §9: ``status``, ``queue``, ``task``, plus
``due_from``/``due_to`` in UTC, ``error``, a substring of ``last_error``, and ``tags``,
comma-separated: jobs holding every one) and are
validated into a ``JobFilter`` before any query runs. A request from htmx (the
overview's polling) gets only the page's body fragment.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from scheduler.broker_view import read_broker
from scheduler.config import Settings
from scheduler.cron import ScheduleSpecError
from scheduler.dashboard import charts, present
from scheduler.dashboard.auth import local_path
from scheduler.dashboard.shards import ETCD_TIMEOUT, read_shard_etcd, read_shards
from scheduler.dashboard.site import DB_ERRORS, Dashboard, ShardSite
from scheduler.errors import InvalidInput, WorkflowNotFound
from scheduler.log import get_logger, scrub
from scheduler.planning import upcoming_fire_times
from scheduler.shards.status import Member
from scheduler.status import (
    STALE_RENEWALS,
    EtcdView,
    evaluate,
    limits_holding,
    read_election_key,
)
from scheduler.store import JobFilter
from scheduler.store.dashboard import LAG_SAMPLE, MINUTE_SAMPLE
from scheduler.store.rows import JOB_STATUSES, Job, OverviewData

log = get_logger(__name__)

PAGE_SIZE = 50
SCHEDULES_SHOWN = 500
RECENT_RUNS = 20
UPCOMING = 10
FILTER_FIELDS = ("status", "queue", "task", "due_from", "due_to", "error", "tags")
ORDER_NOTE: dict[str | None, str] = {
    "pending": "soonest runnable first",
    "dead": "most recently dead first",
    "dispatched": "longest without a sign of life first",
}


def _when(text: str, name: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"{name}: {text!r} is not a date and time (ISO 8601)") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def parse_filter(params: Mapping[str, str]) -> JobFilter:
    """A ``JobFilter`` from query or form fields; empty fields mean "any"."""
    values = {k: (params.get(k) or "").strip() or None for k in FILTER_FIELDS}
    return JobFilter(
        status=values["status"],
        queue=values["queue"],
        task=values["task"],
        due_from=_when(values["due_from"], "due_from") if values["due_from"] else None,
        due_to=_when(values["due_to"], "due_to") if values["due_to"] else None,
        error=values["error"],
        tags=split_tags(values["tags"]),
    )


def split_tags(text: str | None) -> list[str]:
    """The ``tags`` field: tags separated by commas or whitespace (neither can be part
    of a tag)."""
    return [t for t in (text or "").replace(",", " ").split() if t]


def filter_fields(params: Mapping[str, str]) -> dict[str, str]:
    """The filter as it was typed, for form values and links."""
    return {k: params[k] for k in FILTER_FIELDS if params.get(k)}


async def _ping(dash: Dashboard, name: str) -> str:
    try:
        async with asyncio.timeout(1.0):
            await dash.shard(name).status.ping()
    except Exception:  # any failure is "down" here; pages show the detail
        return "down"
    return "up"


async def healthz(dash: Dashboard, request: Request) -> Response:
    """Liveness (200 while serving) with the databases' state for the curious: with
    shards, ``database`` is "up" only when every shard's is, and ``shards`` has each."""
    names = dash.shard_names
    states = dict(zip(names, await asyncio.gather(*(_ping(dash, n) for n in names)), strict=True))
    body: dict[str, Any] = {
        "status": "ok",
        "database": "up" if all(s == "up" for s in states.values()) else "down",
        "read_only": dash.read_only,
    }
    if dash.sharded:
        body["shards"] = states
    return JSONResponse(body)


async def login_form(dash: Dashboard, request: Request) -> Response:
    if not dash.auth.required:
        return RedirectResponse("/", status_code=303)
    target = request.query_params.get("next", "/")
    return dash.render(request, "login.html", next=local_path(target))


async def overview(dash: Dashboard, request: Request) -> Response:
    site = dash.site(request)
    if not dash.sharded:
        context = _overview(dash, await site.views.overview())
    else:  # the shards' table stays up when the chosen shard cannot be read
        context, shards_view = await asyncio.gather(
            _shard_overview(dash, request, site), read_shards(dash)
        )
        context["shards_view"] = shards_view
    template = "_overview.html" if request.headers.get("hx-request") else "overview.html"
    return dash.render(request, template, **context)


async def _shard_overview(dash: Dashboard, request: Request, site: ShardSite) -> dict[str, Any]:
    try:
        return _overview(dash, await site.views.overview())
    except DB_ERRORS as exc:
        text = scrub(f"{type(exc).__name__}: {exc}")[:300]
        log.warning("dashboard_database_error", path=request.url.path, shard=site.name, error=text)
        return {"data": None, "shard_error": text}


def _overview(dash: Dashboard, data: OverviewData) -> dict[str, Any]:
    queues, totals = present.queue_counts(
        data.snapshot.queues, data.terminal, exact=data.terminal_exact,
        pending_counted=data.pending_at_least is None,
    )  # fmt: skip
    lag_series = present.lag_per_minute(data.lag_samples)
    rate = present.completions_per_minute(data.minutes, cap=MINUTE_SAMPLE)
    return {
        "data": data,
        "queues": queues,
        "totals": totals,
        "fence": data.snapshot.fence,
        "stale_after": STALE_RENEWALS * dash.settings.lease_ttl,
        "lag5": present.lag_window(data.lag_samples, 5),
        "lag60": present.lag_window(data.lag_samples, 60),
        "throughput_chart": charts.bar_chart(
            rate.per_minute, minutes=60, title="Jobs completed per minute, last 60 minutes"
        ),
        "rate": rate,
        "minute_sample": MINUTE_SAMPLE,
        "lag_sample": LAG_SAMPLE,
        "lag_chart": charts.line_chart(
            lag_series, minutes=60, title="Fire lag p50/p99 per minute (seconds)", unit="s"
        ),
        "completed_5m": rate.total(5),
        "completed_60m": rate.total(60),
    }


async def jobs(dash: Dashboard, request: Request) -> Response:
    site = dash.site(request)
    params = request.query_params
    where = parse_filter(params)
    page = await site.views.jobs_page(where, cursor=params.get("cursor"), limit=PAGE_SIZE)
    fields = filter_fields(params)
    return dash.render(
        request, "jobs.html", jobs=page.jobs, fields=fields, statuses=JOB_STATUSES,
        next_cursor=page.next_cursor, where=where, order=ORDER_NOTE.get(where.status),
    )  # fmt: skip


async def bulk_preview(dash: Dashboard, request: Request) -> Response:
    site = dash.site(request)
    if dash.read_only:
        return dash.render(request, "error.html", 403, title="Read-only", message="read-only")
    params = request.query_params
    action = params.get("action", "")
    where = parse_filter(params)
    preview = await site.jobs.preview_matching(action, where)
    return dash.render(
        request, "bulk.html", preview=preview, fields=filter_fields(params), where=where
    )


def job_actions(job: Job, now: datetime) -> list[str]:
    """The buttons the job's state allows (each is also checked by its transition)."""
    allowed = []
    if job.status == "dead":
        allowed.append("retry")
    if job.status in ("pending", "dispatched"):
        allowed.append("cancel")  # a dispatched job's worker stops its handler
    if job.status == "pending":
        if job.next_run_at > now and job.due_at <= now:
            allowed.append("run-now")
    return allowed


async def job(dash: Dashboard, request: Request) -> Response:
    site = dash.site(request)
    found = await site.jobs.get(request.path_params["job_id"])
    detail = await site.views.job_detail(found)
    payload, payload_cut = present.pretty_json(found.payload)
    meta, meta_cut = present.pretty_json(found.meta) if found.meta else ("", False)
    result, result_cut = (
        present.pretty_json(found.result) if found.result is not None else ("", False)
    )
    error, error_cut = present.capped(found.last_error)
    lag = None
    if found.dispatched_at is not None:
        lag = (found.dispatched_at - found.next_run_at).total_seconds()
    # staged ahead (DESIGN §14): dispatched, its heartbeat_at (= its run time) still ahead
    staged = (
        found.status == "dispatched"
        and found.heartbeat_at is not None
        and found.heartbeat_at > dash.clock.now()
    )
    return dash.render(
        request, "job.html", job=found, detail=detail, payload=payload, staged=staged,
        payload_cut=payload_cut, error=error, error_cut=error_cut, lag=lag,
        result=result, result_cut=result_cut, meta=meta, meta_cut=meta_cut,
        actions=[] if dash.read_only else job_actions(found, dash.clock.now()),
        cap=present.PAYLOAD_CAP,
    )  # fmt: skip


#: the most jobs a workflow page lists
WORKFLOW_SHOWN = 2000


async def workflow(dash: Dashboard, request: Request) -> Response:
    """One workflow (migration 0025): each job, its state and what it waits for."""
    workflow_id = request.path_params["workflow_id"]
    rows = await dash.site(request).jobs.workflow(workflow_id, limit=WORKFLOW_SHOWN)
    if not rows:
        raise WorkflowNotFound(workflow_id)
    counts: dict[str, int] = {}
    for j in rows:
        counts[j.status] = counts.get(j.status, 0) + 1
    unfinished = sum(counts.get(s, 0) for s in ("pending", "dispatched", "waiting"))
    return dash.render(
        request, "workflow.html", workflow_id=workflow_id, jobs=rows, counts=counts,
        capped=len(rows) == WORKFLOW_SHOWN, can_cancel=unfinished > 0 and not dash.read_only,
    )  # fmt: skip


async def schedules(dash: Dashboard, request: Request) -> Response:
    rows = await dash.site(request).schedules.list(limit=SCHEDULES_SHOWN)
    return dash.render(
        request, "schedules.html", schedules=rows, capped=len(rows) == SCHEDULES_SHOWN
    )


async def schedule(dash: Dashboard, request: Request) -> Response:
    site = dash.site(request)
    found = await site.schedules.get(request.path_params["name"])
    runs = await site.schedules.recent_runs(found.id, RECENT_RUNS)
    now = dash.clock.now()
    upcoming: list[present.FireTime] = []
    problem = None
    if not found.paused:
        try:
            zone = ZoneInfo(found.timezone)
            upcoming = present.fire_times(upcoming_fire_times(found, now, UPCOMING), zone)
        except (ScheduleSpecError, ValueError, KeyError) as exc:
            problem = str(exc)
    run_rows = [
        {
            "job": r,
            "lag": (r.dispatched_at - r.next_run_at).total_seconds() if r.dispatched_at else None,
        }
        for r in runs
    ]
    planned = [r for r in runs if r.status == "pending" and r.due_at > now]
    return dash.render(
        request, "schedule.html", schedule=found, upcoming=upcoming, problem=problem,
        runs=run_rows, planned=planned,
    )  # fmt: skip


#: Keys shown per per-key limit on the Limits page (the most due jobs first).
KEYS_SHOWN = 20


async def limits(dash: Dashboard, request: Request) -> Response:
    """Each limit with its use now (running, started in its rate's window, due jobs it
    holds back, with a ``limit_holding`` note when full) and each per-key limit's
    busiest keys."""
    store = dash.site(request).limits
    try:
        rows = await store.list()
        keys = await store.busiest_keys(KEYS_SHOWN)
    except (asyncpg.UndefinedTableError, asyncpg.UndefinedColumnError):
        rows, keys = [], []  # a schema from before the limits' migrations
    holding = {row.limit.target: f.message for row in rows for f in limits_holding([row])}
    by_target: dict[str, list[Any]] = {}
    for key in keys:
        by_target.setdefault(key.target, []).append(key)
    return dash.render(
        request, "limits.html", limits=rows, keys=by_target, holding=holding,
        keys_shown=KEYS_SHOWN,
    )  # fmt: skip


async def cluster(dash: Dashboard, request: Request) -> Response:
    settings = dash.settings
    site = dash.site(request)
    members: tuple[Member, ...] | None = None  # the live replicas, known only with shards
    etcd_task = asyncio.create_task(
        read_shard_etcd(settings, site.name) if dash.sharded else _unsharded_etcd(settings)
    )
    snapshot, db_error = None, None
    try:
        snapshot = await site.status.snapshot()
    except Exception as exc:  # shown on the page next to what etcd and RabbitMQ say
        db_error = f"{type(exc).__name__}: {exc}"[:300]
    etcd, members = await etcd_task
    queues = {q.queue for q in snapshot.queues} if snapshot else set()
    broker = await read_broker(settings, queues | {"default"})
    report = (
        evaluate(snapshot, etcd, lease_ttl=settings.lease_ttl, max_backlog_age=60.0, broker=broker)
        if snapshot
        else None
    )
    dispatched = {q.queue: q for q in snapshot.queues} if snapshot else {}
    return dash.render(
        request, "cluster.html", snapshot=snapshot, db_error=db_error, etcd=etcd,
        broker=broker, report=report, dispatched=dispatched, settings=settings,
        members=members,
    )  # fmt: skip


async def _unsharded_etcd(settings: Settings) -> tuple[EtcdView, None]:
    return await read_election_key(settings, timeout=ETCD_TIMEOUT), None
