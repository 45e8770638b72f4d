"""The one object every dashboard handler receives: settings, the dashboard's own small
pools (one per shard) and the stores on them, the auth keys, read-only mode and the
templates.

It lives apart from ``app`` (routes, middleware) so the handler modules ``pages`` and
``actions`` can name it without importing the application that imports them. Each pool
is the dashboard's own: at most ``POOL_MAX`` connections per shard with a
``statement_timeout``, so an operator's browser can never take the connections the
scheduler and workers need, nor run a query for minutes. ``min_size=0`` lets the process
start while a shard's PostgreSQL is down: that shard's pages then say so (503) and
recover by themselves when it is back; the other shards are not affected.

Shards: job ids and schedule names are per shard, so every page and action works on one
shard, named by the ``shard`` query or form parameter (default: the first configured
shard; an unknown name is ``UnknownShard``, a 404). ``ShardSite`` is that shard as a
handler sees it: its stores, and ``url`` for links and redirects, which carry the shard
only when there is more than one, so an unsharded dashboard's links are what they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import quote, unquote, urlencode

import asyncpg
import jinja2
from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import HTMLResponse

from scheduler import db
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.dashboard import present
from scheduler.dashboard.auth import Auth, split_listen
from scheduler.dashboard.hosts import Hosts
from scheduler.errors import DuetimeError
from scheduler.store import DashboardStore, JobStore, ScheduleStore
from scheduler.store.limits import LimitStore
from scheduler.store.status import StatusStore

__all__ = [
    "DB_ERRORS",
    "FLASH_COOKIE",
    "POOL_MAX",
    "STATEMENT_TIMEOUT_MS",
    "Dashboard",
    "ShardSite",
    "UnknownShard",
]

#: What a page's database read may raise when the database cannot answer (a 503 page).
DB_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)
POOL_MAX = 3  # per shard
STATEMENT_TIMEOUT_MS = 5000
#: A one-shot message for the next page (set by an action's redirect, shown once).
FLASH_COOKIE = "duetime_flash"
#: Where the shard picker leads from a page: the same section, since an id or a
#: schedule name of one shard means nothing on another.
SECTIONS = ("/jobs", "/schedules", "/limits", "/cluster")


class UnknownShard(DuetimeError):
    """The ``shard`` parameter names no configured shard (answered with a 404)."""


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


@dataclass(frozen=True, slots=True)
class ShardSite:
    """One shard of the dashboard, as the request's handler uses it."""

    name: str
    linked: bool  # links name the shard (more than one is configured)
    opened: asyncpg.Pool | None = None  # None outside the lifespan (before open, after close)

    @property
    def pool(self) -> asyncpg.Pool:
        if self.opened is None:  # answered like any unusable database: a 503 page
            raise asyncpg.InterfaceError("the dashboard's database pools are not open")
        return self.opened

    @property
    def jobs(self) -> JobStore:
        return JobStore(self.pool)

    @property
    def schedules(self) -> ScheduleStore:
        return ScheduleStore(self.pool)

    @property
    def views(self) -> DashboardStore:
        return DashboardStore(self.pool)

    @property
    def limits(self) -> LimitStore:
        return LimitStore(self.pool)

    @property
    def status(self) -> StatusStore:
        return StatusStore(self.pool)

    def url(self, path: str, **params: Any) -> str:
        """``path`` with ``params`` (empty ones left out) and, when linked, the shard."""
        query = {k: str(v) for k, v in params.items() if v is not None and v != ""}
        if self.linked:
            query["shard"] = self.name
        return f"{path}?{urlencode(query)}" if query else path

    def field(self) -> Markup:
        """The hidden form field that sends the shard with a POST (empty when unlinked)."""
        if not self.linked:
            return Markup("")
        return Markup('<input type="hidden" name="shard" value="{}">').format(self.name)


@dataclass
class Dashboard:
    settings: Settings
    auth: Auth
    read_only: bool = False
    hosts: Hosts | None = None  # None: from settings (the listening port as configured)
    templates: jinja2.Environment = field(default_factory=_templates)
    pools: dict[str, asyncpg.Pool] = field(default_factory=dict)
    clock: Clock = SYSTEM_CLOCK  # "now" of the job actions offered and the fire times shown

    @property
    def allowed_hosts(self) -> Hosts:
        """The ``Host`` names this dashboard answers to (``scheduler.dashboard.hosts``)."""
        if self.hosts is None:
            host, port = split_listen(self.settings.dashboard_listen)
            self.hosts = Hosts.for_listen(host, port, self.settings.dashboard_hosts)
        return self.hosts

    @property
    def shard_names(self) -> list[str]:
        """The configured shards in order (``main`` alone when unsharded)."""
        return list(self.settings.shard_urls)

    @property
    def sharded(self) -> bool:
        """Shards are configured (``DUETIME_SHARDS``): election keys are per shard."""
        return self.settings.shards is not None

    @property
    def pool(self) -> asyncpg.Pool | None:
        """The first shard's pool (the one database when unsharded)."""
        return self.pools.get(self.shard_names[0])

    def site(self, request: Request, form: Mapping[str, Any] | None = None) -> ShardSite:
        """The shard this request works on (``shard`` in the query, else in the posted
        form, else the first); remembered on the request for ``render``."""
        name = request.query_params.get("shard") or (form or {}).get("shard")
        site = self.shard(str(name) if name else self.shard_names[0])
        request.state.site = site
        return site

    def shard(self, name: str) -> ShardSite:
        """The shard ``name``; ``UnknownShard`` when none is configured by that name."""
        names = self.shard_names
        if name not in names:
            shown = ", ".join(names)
            raise UnknownShard(f"no shard named {name[:40]!r}: this dashboard serves {shown}")
        return ShardSite(name, len(names) > 1, self.pools.get(name))

    async def open(self) -> None:
        for name, url in self.settings.shard_urls.items():
            self.pools[name] = await db.create_pool(
                url,
                min_size=0,
                max_size=POOL_MAX,
                timeout=self.settings.db_timeout,
                application_name="duetime-dashboard",
                pooler=self.settings.database_pooler,
                display=True,  # any row the database accepts renders (deep JSON too)
                server_settings={
                    "statement_timeout": str(STATEMENT_TIMEOUT_MS),
                    "idle_in_transaction_session_timeout": str(STATEMENT_TIMEOUT_MS * 2),
                },
            )

    async def close(self) -> None:
        pools, self.pools = self.pools, {}
        for pool in pools.values():
            await pool.close()

    def render(
        self, request: Request, template: str, status_code: int = 200, **context: Any
    ) -> HTMLResponse:
        flash = request.cookies.get(FLASH_COOKIE)
        names = self.shard_names
        site: ShardSite | None = getattr(request.state, "site", None)
        if site is None:  # a page of no shard (login, an error before one was chosen)
            site = ShardSite(names[0], len(names) > 1, self.pool)
        path = request.url.path
        html = self.templates.get_template(template).render(
            request=request,
            read_only=self.read_only,
            auth_required=self.auth.required,
            csrf=self.auth.csrf_token(request.state.csrf_binding),
            flash=unquote(flash)[:500] if flash else None,
            nav=path,
            url=site.url,
            shard=site.name,
            shard_field=site.field(),
            shards=names if len(names) > 1 else [],
            section=next((s for s in SECTIONS if path.startswith(s)), "/"),
            **context,
        )
        response = HTMLResponse(html, status_code=status_code)
        if flash:
            response.delete_cookie(FLASH_COOKIE, path="/")
        return response
