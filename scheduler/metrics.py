"""Every Prometheus metric duetime exposes, defined once (names are part of what
operators alert on; docs/operations.md explains each).

A metric about one shard's work (what a duty did, what a worker's executor settled)
carries a ``shard`` label: the shard's configured name, ``main`` when unsharded, so its
values stay bounded by the configuration. The code that does the work knows its shard
(a duty from its ``DutyContext``, an executor from the worker's shard it was built for)
and passes it at every observation. The counters with no other label (publish
failures, reconciled, schedule fires, row mismatches) are set up per shard when a duty
or an executor is built, so they expose 0 from the start and ``increase()`` sees their
first increment. Process-wide metrics have no ``shard`` label: the
single-shard leadership gauges (``duetime_shard_*`` are their per-shard counterparts),
the event-loop lag, and the consumer's counts of messages it settles before any shard's
executor sees them (malformed, requeued).

Buckets span 1 ms … 60 s: a scheduler's lags live from milliseconds (idle) to tens
of seconds (storms, failover).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LAG_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

IS_LEADER = Gauge("duetime_is_leader", "1 while this replica holds leadership")
LEADER_EPOCH = Gauge("duetime_leader_epoch", "epoch (fencing token) of the current term")
LEADER_TRANSITIONS = Counter(
    "duetime_leader_transitions_total", "leadership gained or lost, by reason", ["reason"]
)
SHARD_IS_LEADER = Gauge(
    "duetime_shard_is_leader", "1 while this replica leads the shard (duties running)", ["shard"]
)
SHARD_EPOCH = Gauge(
    "duetime_shard_epoch", "epoch (fencing token) of this replica's term of the shard", ["shard"]
)
SHARD_TRANSITIONS = Counter(
    "duetime_shard_transitions_total",
    "shard leadership gained (elected) or given up, by reason",
    ["shard", "reason"],
)
JOBS_CLAIMED = Counter(
    "duetime_jobs_claimed_total", "jobs claimed for dispatch", ["shard", "queue"]
)
JOBS_PUBLISHED = Counter(
    "duetime_jobs_published_total", "jobs published and confirmed by RabbitMQ", ["shard", "queue"]
)
JOBS_STAGED = Counter(
    "duetime_jobs_staged_total",
    "jobs handed to workers before their run time (staging ahead, DESIGN §14)",
    ["shard", "queue"],
)
STAGED_HELD = Gauge(
    "duetime_staged_held",
    "staged deliveries this worker holds until their run time (workers)",
)
HANDLERS_RUNNING = Gauge(
    "duetime_worker_handlers_running",
    "handler slots taken in this worker (at most its concurrency)",
)
DELIVERIES_WAITING = Gauge(
    "duetime_worker_deliveries_waiting",
    "deliveries this worker has read and that wait for a handler slot (all slots busy)",
)
DELIVERIES_AWAITING_DATABASE = Gauge(
    "duetime_worker_deliveries_awaiting_database",
    "deliveries this worker holds because their outcome could not be recorded: each goes "
    "back to the queue when its database answers again, or after 10 s",
    ["shard"],
)
STAGED_DUE_WAITING = Gauge(
    "duetime_staged_due_waiting",
    "staged deliveries whose run time came and that wait for room to start (workers): "
    "at most the worker's prefetch of them are begun at once",
)
STAGED_RELEASED = Counter(
    "duetime_staged_released_total",
    "staged deliveries at their run time (workers): started (given room to start), "
    "moved (the row's run time is later: given back to pending), requeued (worker "
    "stopping: back to the broker)",
    ["outcome"],
)
PUBLISH_FAILURES = Counter(
    "duetime_publish_failures_total",
    "publishes not confirmed (jobs returned to pending)",
    ["shard"],
)
DISPATCH_UNCOMMITTED = Counter(
    "duetime_dispatch_uncommitted_jobs_total",
    "jobs confirmed by RabbitMQ whose claim then failed to commit (copies a worker skips)",
    ["shard"],
)
DISPATCH_AFTER_COMMIT = Counter(
    "duetime_dispatch_after_commit_total",
    "jobs published after their claim committed, since an uncommitted claim had already "
    "published them, by outcome (confirmed, failed: left to the reconciler)",
    ["shard", "outcome"],
)
DISPATCH_LAG = Histogram(
    "duetime_dispatch_lag_seconds", "dispatched_at minus run time", ["shard"], buckets=LAG_BUCKETS
)
FIRE_LAG = Histogram(
    "duetime_fire_lag_seconds",
    "handler start minus run time (workers)",
    ["shard"],
    buckets=LAG_BUCKETS,
)
JOBS_FINISHED = Counter(
    "duetime_jobs_finished_total",
    "deliveries finished, by task and outcome (succeeded, retried, dead, skipped, "
    "cancelled: stopped while running, snoozed: back to pending without using an attempt)",
    ["shard", "task", "outcome"],
)
HANDLERS_CANCELLED = Counter(
    "duetime_handlers_cancelled_total",
    "running handlers a worker stopped because their job was cancelled (workers)",
    ["shard"],
)
JOBS_CANCELLED = Counter(
    "duetime_jobs_cancelled_total",
    "jobs cancelled through JobStore (CLI, dashboard, API), by the state they were in "
    "(pending, dispatched: running or about to run)",
    ["was"],
)
UNIQUE_CONFLICTS = Counter(
    "duetime_unique_conflicts_total",
    "JobStore.enqueue calls whose unique key was held: skipped, replaced (debounce), "
    "refused (on_conflict='error'); plain-SQL inserts are not counted",
    ["outcome"],
)
JOB_DURATION = Histogram(
    "duetime_job_duration_seconds", "handler run time", ["shard", "task"], buckets=LAG_BUCKETS
)
THREADS_ABANDONED = Counter(
    "duetime_worker_threads_abandoned_total",
    "plain def handlers whose attempt timed out or was stopped while their thread ran on",
)
THREADS_ABANDONED_ALIVE = Gauge(
    "duetime_worker_abandoned_threads",
    "abandoned handler threads still running (past max_abandoned_threads the worker restarts)",
)
RECONCILED = Counter("duetime_reconciled_total", "stalled dispatched jobs re-published", ["shard"])
JOBS_PARKED = Counter(
    "duetime_jobs_parked_total",
    "jobs the scheduler made dead itself (unreadable row, re-publish cap)",
    ["shard", "reason"],
)
BACKLOG = Gauge("duetime_backlog_jobs", "pending jobs whose run time has passed", ["shard"])
WAITING = Gauge(
    "duetime_waiting_jobs",
    "jobs waiting for their dependencies (workflows); sampled by the leader with the backlog",
    ["shard"],
)
OLDEST_UNSTARTED = Gauge(
    "duetime_oldest_unstarted_seconds",
    "seconds since the oldest dispatched job no worker has started was dispatched (0: none)",
    ["shard"],
)
JOBS_HELD = Gauge(
    "duetime_jobs_held",
    "due pending jobs the dispatcher holds back (reason queue_undeclared: no duetime queues add)",
    ["shard", "reason"],
)
QUEUE_PAUSED = Gauge(
    "duetime_queue_paused",
    "1 while the queue is paused (duetime queues pause: nothing new of it is dispatched), "
    "0 for every other declared queue; sampled by the leader with the backlog",
    ["shard", "queue"],
)
LIMIT_HELD = Gauge(
    "duetime_limit_held",
    "due pending jobs of a limited task or queue, held back by its limit (duetime limits)",
    ["shard", "limit"],
)
LIMIT_STARTS = Counter(
    "duetime_limit_starts_total",
    "jobs of a rate-limited task or queue started (dispatched), as logged for its window "
    "(duetime limits --rate)",
    ["shard", "limit"],
)
DISPATCH_CREDIT = Gauge(
    "duetime_dispatch_credit",
    "messages the dispatcher may still publish to a queue before its broker buffer is full "
    "(0: its due jobs are held in PostgreSQL until workers take some)",
    ["shard", "queue"],
)
SCHEDULE_FIRES = Counter(
    "duetime_schedule_fires_total", "fire times materialized as jobs", ["shard"]
)
SCHEDULE_MISFIRES = Counter(
    "duetime_schedule_misfires_total",
    "fire times missed (skipped or caught up)",
    ["shard", "policy"],
)
EVENT_LOOP_LAG = Histogram(
    "duetime_event_loop_lag_seconds", "asyncio event loop scheduling delay", buckets=LAG_BUCKETS
)
DUTY_FAILURES = Counter(
    "duetime_duty_failures_total", "leader duty passes that raised", ["shard", "duty"]
)
MALFORMED_MESSAGES = Counter(
    "duetime_malformed_messages_total", "messages dead-lettered as unparseable"
)
DELIVERIES_REQUEUED = Counter(
    "duetime_deliveries_requeued_total",
    "deliveries nacked back to the queue because no outcome could be recorded",
)
DELIVERIES_DROPPED = Counter(
    "duetime_deliveries_dropped_total",
    "deliveries acked without running: a copy of an attempt already running in this "
    "worker (running), a message of another dispatch than the row's (stale_epoch), a "
    "shard no worker here knows (unknown_shard, dead-lettered)",
    ["shard", "reason"],
)
MESSAGE_ROW_MISMATCH = Counter(
    "duetime_message_row_mismatch_total",
    "deliveries whose message named another task than the job row (security event; the row is run)",
    ["shard"],
)
