-- The leader's dispatch path on duetime.jobs (DESIGN §5): claim, mark dispatched,
-- probe the next run time, sample the backlog, and rescue stalled dispatched jobs.
-- Run time = coalesce(run_at, due_at); every predicate on it is written exactly like the
-- partial indexes' expressions so the planner uses them, and every statement that can
-- also says `due_at <= now()` (true whenever the run time is due, because run_at is
-- never earlier than due_at) so future partitions are pruned.

-- name: claimed_columns
-- What `claim`, `claimed_row` and the stalled statements return of a job: a pointer at
-- the row, never the payload (the worker reads it from the row). Spliced into `{columns}`
-- by DispatchStore (scheduler.sql.compose), as is `stalled_columns`.
id, task, queue, due_at, run_at, attempt

-- name: ordered_claim
-- Inside the dispatcher's fenced transaction, just before `claim` (DispatchStore.claim):
-- plan it as ordered index scans whatever the statistics say. Its plan is made once per
-- connection; made while a bucket's statistics still describe it as nearly empty (a bulk
-- INSERT of due jobs that autovacuum has not analysed yet), it sorted every due row for
-- each batch instead: 78 ms per 500 jobs with 255,000 due, against 1.1 ms
-- (docs/benchmarks.md, "The due claim on a bucket not yet analysed"). A sort is still
-- planned where no index can give the order.
SET LOCAL enable_sort = off;

-- name: default_sort
-- Back to the session's choice for the rest of the claim transaction.
SET LOCAL enable_sort TO DEFAULT;

-- name: claim
-- Runs inside the dispatcher's fenced transaction. SKIP LOCKED: rows held by a concurrent
-- claimer, a canceller or a worker (FOR KEY SHARE) are left for a later pass. The limit
-- placeholder is the pass's limit (the batch size, or less when the broker's buffer has
-- less room: scheduler.duties.credit), spliced in as an integer literal by DispatchStore
-- (never text from outside), so the statement is planned once per connection and limit
-- (with `LIMIT $1` PostgreSQL re-planned it on every execution; measured in
-- docs/benchmarks.md, "Notes moved from the SQL"); now() still prunes the partitions at
-- executor start. The columns placeholder is `claimed_columns`, or only `id` when a row
-- of the claim cannot be read by the client (a value outside what Python holds, JSON
-- nested deeper than its parser goes): the same rows, locked the same way, each then
-- read alone (claimed_row) and the unreadable ones parked. The id-only form runs only
-- after the full one failed, never on the hot path.
-- Only jobs of a declared queue that is not paused (duetime.queues, migration 0008;
-- `duetime queues pause`: running jobs finish, nothing new goes out): a producer's queue name
-- never reaches the broker until an operator declared it; the others are held (counted
-- by `held`). EXISTS plans as a Nested Loop (Memoize over queues_pkey) above the Merge
-- Append of index scans, so the claim stays ordered by the index; held rows due
-- earlier are stepped over, one memoized lookup each (docs/operations.md, "Queues").
-- {held}: queues whose broker buffer is full (held for credit: skipped); {max_wait}:
-- priority_max_wait in seconds. Both are literals too (validated queue names, a float):
-- with parameters PostgreSQL kept re-planning (custom plans, ~15-20 ms with 17
-- partitions, per claim); the held set is almost always empty or one queue.
-- {skip_tasks} (and the limited queues, added to {held}): targets of a concurrency limit
-- (migration 0016), whose jobs only the limited claim takes (limits.sql `claim`); empty
-- while no limit exists, so a claim without limits is the same index scan as before.
-- Order (docs/architecture.md, "Who decides the order"): first the jobs due for longer
-- than max_wait, oldest first, from jobs_pending_run_idx (`aged`); then the other due
-- jobs by priority, highest first, then run time, from jobs_pending_priority_idx
-- (migration 0015; `fresh`). Each is an ordered index scan under its own LIMIT and lock;
-- the Append reads `fresh` only when `aged` returned fewer rows than the limit. `fresh`
-- has no lower bound on the run time, only a filter on the ids `aged` locked (one array,
-- computed once): with a range `> now() - max_wait` the planner underestimated the rows
-- in it and sorted every due row instead (300 ms on 200k rows), and with NOT EXISTS it
-- chose a hash anti-join and a sort on small tables. One ORDER BY over an "aged"
-- expression could not be read from any index at all. EXPLAINs: docs/benchmarks.md,
-- "Priorities".
WITH aged AS MATERIALIZED (
 SELECT {columns}
   FROM duetime.jobs AS j
  WHERE status = 'pending'
    AND coalesce(run_at, due_at) <= now() - make_interval(secs => {max_wait})
    AND due_at <= now()
    AND queue <> ALL({held})
    AND task <> ALL({skip_tasks})
    AND EXISTS (SELECT 1 FROM duetime.queues AS q
                 WHERE q.name = j.queue AND NOT q.paused)
  ORDER BY coalesce(run_at, due_at)
  LIMIT {limit}
    FOR UPDATE SKIP LOCKED)
SELECT * FROM aged
UNION ALL
SELECT * FROM (
 SELECT {columns}
   FROM duetime.jobs AS j
  WHERE status = 'pending'
    AND coalesce(run_at, due_at) <= now()
    AND due_at <= now()
    AND queue <> ALL({held})
    AND task <> ALL({skip_tasks})
    AND EXISTS (SELECT 1 FROM duetime.queues AS q
                 WHERE q.name = j.queue AND NOT q.paused)
    AND j.id <> ALL (ARRAY(SELECT aged.id FROM aged))
  ORDER BY priority DESC, coalesce(run_at, due_at)
  LIMIT {limit}
    FOR UPDATE SKIP LOCKED) AS fresh
 LIMIT {limit};

-- name: stageable
-- The jobs staging may take (`claim_staged`) and looks for (`next_stage_in`): one text,
-- so the probe never finds a job the claim would not take (the loop would spin on it).
-- Spliced into `{stageable}` by DispatchStore (scheduler.store.dispatch.staging_sql).
-- `OFFSET 0` keeps each EXISTS a per-row filter of the ordered index scan instead of a
-- join (PostgreSQL does not turn a subquery with an OFFSET into one): as an anti-join
-- with duetime.limits the planner expected almost no job to pass, so "the first job in
-- run-time order" became "sort every pending job of every later bucket", 25 ms per
-- probe with 30,000 jobs ahead against 0.12 ms, growing with every job scheduled
-- (docs/benchmarks.md, "The staging probe sorted every job ahead").
status = 'pending'
   AND coalesce(run_at, due_at) > now()
   AND unique_key IS NULL
   AND queue <> ALL({held})
   AND task <> ALL({skip_tasks})
   AND NOT EXISTS (SELECT 1 FROM duetime.limits AS l
                    WHERE l.target IN ('task:' || j.task, 'queue:' || j.queue)
                   OFFSET 0)
   AND EXISTS (SELECT 1 FROM duetime.queues AS q
                WHERE q.name = j.queue AND NOT q.paused
               OFFSET 0)

-- name: claim_staged
-- Staging ahead (DESIGN §14; docs/architecture.md, "Staging"): in the dispatcher's fenced
-- transaction, after the due claim left room, the pending jobs whose run time falls
-- within the next {ahead} seconds, earliest first. They are published to their queue's
-- staged queue and marked by `mark_staged`; a worker holds each until its run time. Not
-- staged: the jobs of the targets of a limit (a limit is decided when a job starts, not
-- seconds before; read here in the claim's own snapshot, so a limit set a moment ago
-- counts although the dispatcher's copy of the limits is refreshed every second; the
-- {skip_tasks} and limited queues in {held} of that copy are kept too), jobs with a unique
-- key (a debounce, on_conflict 'replace', moves a pending holder's run time and payload
-- and leaves a dispatched one alone: staged, it would stop being debounced seconds
-- early), queues whose staged buffer is full ({held}), undeclared or paused queues.
-- Same index (jobs_pending_run_idx) and the same literal placeholders as `claim`, for
-- the same reasons; `due_at <= now() + ahead` prunes the buckets further out.
SELECT {columns}
  FROM duetime.jobs AS j
 WHERE {stageable}
   AND coalesce(run_at, due_at) <= now() + make_interval(secs => {ahead})
   AND due_at <= now() + make_interval(secs => {ahead})
 ORDER BY coalesce(run_at, due_at)
 LIMIT {limit}
   FOR UPDATE SKIP LOCKED;

-- name: next_stage_in
-- Seconds from now until the earliest run time of a job `claim_staged` could take,
-- after now (NULL when none): the dispatcher stages again `ahead` seconds before it. The
-- same ordered index scan as next_run_in, with claim_staged's filters (`stageable`).
SELECT extract(epoch FROM (
           SELECT coalesce(run_at, due_at)
             FROM duetime.jobs AS j
            WHERE {stageable}
            ORDER BY coalesce(run_at, due_at)
            LIMIT 1
       ) - clock_timestamp())::float8;

-- name: claimed_row
-- One row the id-only claim locked (by id alone: jobs_id_idx, one probe per bucket).
SELECT {columns}
  FROM duetime.jobs
 WHERE id = $1 AND status = 'pending';

-- name: park
-- A row the dispatcher or the reconciler cannot read goes dead with the reason, instead
-- of failing every claim it sorts into. By id alone (its due_at may be what cannot be
-- read); the caller holds the row's lock.
UPDATE duetime.jobs
   SET status = 'dead', finished_at = now(), heartbeat_at = NULL, last_error = $2
 WHERE id = $1 AND status IN ('pending', 'dispatched');

-- name: mark_dispatched
-- Only the jobs RabbitMQ confirmed: $1 their ids, $2..$3 the smallest and largest of their
-- due_at. Ids are unique (one sequence), so `id = ANY($1)` finds exactly them, and the
-- due_at range prunes the scan to the partitions the batch lives in (faster than joining
-- `unnest($1, $2)` or `= ANY` on both columns: docs/benchmarks.md, "Notes moved from the
-- SQL"). statement_timestamp() is after the confirms, so dispatched_at and the returned
-- lag include publishing.
-- The fence predicate makes a stale epoch mark nothing; the commit-time trigger
-- jobs_dispatch_fenced (migration 0006) refuses it whatever the statement says.
-- republish_count restarts: the reconciler's cap counts re-publishes of this dispatch.
UPDATE duetime.jobs AS j
   SET status = 'dispatched', dispatched_at = statement_timestamp(), heartbeat_at = NULL,
       dispatch_epoch = $4, republish_count = 0
 WHERE j.id = ANY($1::bigint[])
   AND j.due_at >= $2 AND j.due_at <= $3
   AND j.status = 'pending'
   AND EXISTS (SELECT 1 FROM duetime.leader_fence f WHERE f.shard = 0 AND f.epoch = $4)
RETURNING j.id,
          extract(epoch FROM statement_timestamp() - coalesce(j.run_at, j.due_at))::float8
              AS lag;

-- name: mark_staged
-- `mark_dispatched` for staged jobs: the same transition and fence, and heartbeat_at =
-- the job's run time, so that the reconciler (lock_stalled: no sign of life for the
-- visibility timeout) counts a staged job's silence from the time it is to start, not
-- from when it was staged. A dispatched row whose heartbeat_at is later than now is a
-- staged job not yet started (the dashboard's "staged"). Returns the ids.
UPDATE duetime.jobs AS j
   SET status = 'dispatched', dispatched_at = statement_timestamp(),
       heartbeat_at = coalesce(j.run_at, j.due_at),
       dispatch_epoch = $4, republish_count = 0
 WHERE j.id = ANY($1::bigint[])
   AND j.due_at >= $2 AND j.due_at <= $3
   AND j.status = 'pending'
   AND EXISTS (SELECT 1 FROM duetime.leader_fence f WHERE f.shard = 0 AND f.epoch = $4)
RETURNING j.id;

-- name: next_run_in
-- Seconds from now until the earliest pending run time (negative when overdue, NULL when
-- nothing is pending), computed on the database clock so host clock skew cannot make
-- the dispatcher wake early or late. Plans as a Limit over the per-partition partial
-- indexes. Held jobs (queue not declared) do not count: they must not wake the loop.
-- Written as ORDER BY ... LIMIT 1, not min(): with the EXISTS, min() is no longer turned
-- into an index probe and planned as a scan of every pending row; this form stays the
-- ordered index scan, stopping at the first job of a declared queue (it steps over the
-- held rows due before it, ~1 us each measured).
SELECT extract(epoch FROM (
           SELECT coalesce(run_at, due_at)
             FROM duetime.jobs AS j
            WHERE status = 'pending'
              AND EXISTS (SELECT 1 FROM duetime.queues AS q
                           WHERE q.name = j.queue AND NOT q.paused)
            ORDER BY coalesce(run_at, due_at)
            LIMIT 1
       ) - clock_timestamp())::float8;

-- name: backlog
-- Pending jobs whose run time has passed (sampled for the BACKLOG gauge, not per pass).
SELECT count(*)
  FROM duetime.jobs
 WHERE status = 'pending'
   AND coalesce(run_at, due_at) <= now()
   AND due_at <= now();

-- name: waiting
-- Jobs waiting for their dependencies (migration 0025), sampled with the backlog for the
-- WAITING gauge: a count over the partial index jobs_waiting_idx only.
SELECT count(*) FROM duetime.jobs WHERE status = 'waiting';

-- name: held
-- Due pending jobs held because their queue is not declared (sampled with the backlog):
-- per queue name, the most held first, at most $1 names (a producer may write many), and
-- over every name the total of jobs and of names.
SELECT j.queue, count(*) AS jobs,
       sum(count(*)) OVER ()::bigint AS total_jobs, count(*) OVER () AS total_queues
  FROM duetime.jobs AS j
 WHERE status = 'pending'
   AND coalesce(run_at, due_at) <= now()
   AND due_at <= now()
   AND NOT EXISTS (SELECT 1 FROM duetime.queues AS q WHERE q.name = j.queue)
 GROUP BY j.queue
 ORDER BY jobs DESC, j.queue
 LIMIT $1;

-- name: queue_flags
-- The declared queues and whether each is paused (sampled with the backlog into the
-- duetime_queue_paused gauge), at most $1 of them.
SELECT name, paused FROM duetime.queues ORDER BY name LIMIT $1;

-- name: stalled_columns
-- What the stalled statements return: claimed_columns and the reconciler's bookkeeping.
id, task, queue, due_at, run_at, attempt,
dispatch_epoch, republish_count,
extract(epoch FROM now() - coalesce(heartbeat_at, dispatched_at))::float8 AS silent_for

-- name: lock_stalled
-- Reconciler, inside its fenced transaction: dispatched jobs with no sign of life for
-- $1 seconds, except in the queues $3 (deferred: they still hold a backlog of messages)
-- and in queues no longer declared (a re-publish would declare the broker queue again).
-- A job a worker is executing is kept out of it by its heartbeats (every
-- visibility_timeout / 3); a re-publish that still happens is a duplicate delivery,
-- which the worker's ledger absorbs. Columns: `stalled_columns`, or only `id` when a
-- row of it cannot be read by the client (as for `claim`; each then read by stalled_row).
SELECT {columns}
  FROM duetime.jobs AS j
 WHERE status = 'dispatched'
   AND coalesce(heartbeat_at, dispatched_at) < now() - make_interval(secs => $1)
   AND due_at <= now()
   AND queue <> ALL($3::text[])
   AND EXISTS (SELECT 1 FROM duetime.queues AS q WHERE q.name = j.queue)
 ORDER BY coalesce(heartbeat_at, dispatched_at)
 LIMIT $2
   FOR UPDATE SKIP LOCKED;

-- name: stalled_row
-- One row the id-only lock_stalled locked, as lock_stalled returns it.
SELECT {columns}
  FROM duetime.jobs
 WHERE id = $1 AND status = 'dispatched';

-- name: mark_redispatched
-- Reconciler: the jobs it re-published and RabbitMQ confirmed start a new visibility
-- window under this epoch (same arguments as mark_dispatched). heartbeat_at is cleared,
-- or coalesce(heartbeat_at, dispatched_at) would keep pointing at the old sign of life.
-- republish_count counts toward the cap (give_up), in the row so a new leader keeps it.
UPDATE duetime.jobs AS j
   SET dispatched_at = statement_timestamp(), heartbeat_at = NULL, dispatch_epoch = $4,
       republish_count = j.republish_count + 1
 WHERE j.id = ANY($1::bigint[])
   AND j.due_at >= $2 AND j.due_at <= $3
   AND j.status = 'dispatched'
   AND EXISTS (SELECT 1 FROM duetime.leader_fence f WHERE f.shard = 0 AND f.epoch = $4)
RETURNING j.id;

-- name: give_up
-- Reconciler, same transaction: stalled jobs re-published max_republishes times since
-- they were dispatched go dead instead of cycling forever ($1 ids, $2..$3 their due_at
-- range, $4 the error).
UPDATE duetime.jobs AS j
   SET status = 'dead', finished_at = now(), heartbeat_at = NULL, last_error = $4
 WHERE j.id = ANY($1::bigint[])
   AND j.due_at >= $2 AND j.due_at <= $3
   AND j.status = 'dispatched'
RETURNING j.id;
