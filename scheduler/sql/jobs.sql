-- Client API on duetime.jobs: enqueue, read, list, cancel, retry (DESIGN §3).
-- The dispatcher's and the worker's transitions live in dispatch.sql / execution.sql.

-- name: insert
-- $8: limit_key (migration 0016), NULL for none; $9 tags, $10 meta (migration 0022);
-- $11 traceparent (migration 0023), the enqueuing code's trace context
-- (scheduler.tracing), NULL for none.
INSERT INTO duetime.jobs (task, payload, due_at, queue, max_attempts, idempotency_key,
                          priority, limit_key, tags, meta, traceparent)
VALUES ($1, $2, coalesce($3, now()), $4, $5, $6, $7, $8, $9::text[], $10::jsonb, $11)
RETURNING *;

-- name: insert_unique
-- A job with a unique key (duetime.enqueue_unique of migrations 0014, 0017, 0022 and 0023, one
-- round trip): $1..$8 as for insert, $9 the key, $10 'skip' | 'replace' | 'error', $11 the
-- unique_for window (an interval as text, '' for none), $12 tags, $13 meta, $14 the
-- traceparent as for insert (the overload of migration 0023). One row: the outcome
-- ('inserted', 'skipped', 'replaced' or 'refused'), the id of the job holding the key,
-- and that job's columns (all NULL when it is no longer stored).
SELECT e.outcome, e.holder_id, (e.job).*
  FROM duetime.enqueue_unique($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11,
                              $12::text[], $13::jsonb, $14) AS e;

-- name: get
SELECT * FROM duetime.jobs WHERE id = $1;

-- name: get_as_text
-- `get` for the synchronous drivers (scheduler.store.sync_jobs.get): the jsonb columns
-- again as text, which every driver returns alike (Django's psycopg setup returns jsonb
-- as text, plain psycopg decodes it), so a result that is a JSON string is told apart.
SELECT *, payload::text AS payload_text, result::text AS result_text
  FROM duetime.jobs WHERE id = $1;

-- name: job_filter
-- The predicates of a JobFilter, $1..$6 = JobFilter.params() (queue, task, due window,
-- a substring of last_error, tags): spliced as `{filter}` into the statements that filter
-- jobs, here and in dashboard.sql (scheduler.sql.compose), followed by one of the two
-- tag fragments below (jobs.filter_for).
   AND ($1::text IS NULL OR queue = $1)
   AND ($2::text IS NULL OR task = $2)
   AND ($3::timestamptz IS NULL OR due_at >= $3)
   AND ($4::timestamptz IS NULL OR due_at < $4)
   AND ($5::text IS NULL OR strpos(lower(last_error), lower($5)) > 0)

-- name: job_filter_untagged
-- No tag asked for: $6 is NULL (a one-time filter, so every plan is the one without tags).
   AND $6::text[] IS NULL

-- name: job_filter_tagged
-- Jobs holding every tag of $6, from the partial GIN index jobs_tags_idx (migration 0022),
-- whose predicate is repeated so the planner may use it. A statement of its own, not an
-- `$6 IS NULL OR` branch: a cached generic plan of that form could not use the index.
   AND cardinality(tags) > 0
   AND tags @> $6::text[]

-- name: custom_plans
-- For the rest of the transaction, plan each statement for its parameters (jobs.
-- planned_for): a tag filter's best plan depends on how common its tags are (the tag
-- index for a rare tag; the id order, stopping at the page's end, for a common one), so
-- a cached generic plan, the index whatever the tag, read 1M rows for a common tag at
-- 1M stored jobs (919 ms against 8 ms; docs/benchmarks.md "Tag filter").
SET LOCAL plan_cache_mode = force_custom_plan;

-- name: list
-- Keyset pagination on id: stable and complete while rows are inserted concurrently.
-- $7 the status (any when NULL), $8 the last id of the previous page.
SELECT * FROM duetime.jobs
 WHERE ($7::text IS NULL OR status = $7)
{filter}
   AND ($8::bigint IS NULL OR id > $8)
 ORDER BY id
 LIMIT $9;

-- name: cancel
-- $1: the ids (one for `jobs cancel`, a batch for a cancel by filter): one transition,
-- from pending, waiting (migration 0025: its dependents are cancelled by the trigger
-- jobs_release_dependents in the same transaction) or dispatched (a running job: its worker is told by cancel_notify in the
-- same transaction, migration 0019). $2: who cancels (NULL: the database role). `was`
-- is the status the row left. The rows are locked first, so a settlement racing this
-- cancel either committed before (the row is finished: not cancelled here) or finds
-- the row cancelled and settles nothing.
UPDATE duetime.jobs j
   SET status = 'cancelled', finished_at = now(), heartbeat_at = NULL,
       cancelled_by = left(coalesce($2::text, current_user), 200)
  FROM (SELECT id, due_at, status
          FROM duetime.jobs
         WHERE id = ANY($1::bigint[]) AND status IN ('pending', 'dispatched', 'waiting')
           FOR UPDATE) o
 WHERE j.id = o.id AND j.due_at = o.due_at
RETURNING j.*, o.status AS was;

-- name: cancel_notify
-- The running jobs just cancelled, comma-separated (workers/cancel.py LISTENs): sent at
-- the cancel's COMMIT, so a worker never hears of a cancel that did not happen.
SELECT pg_notify('duetime_cancel', $1::text);

-- name: await_job
-- JobStore.result: register as a waiter for the job's outcome (migration 0019); the
-- caller LISTENs on duetime_job_finished first.
SELECT duetime.await_job($1::bigint);

-- name: unawait_job
SELECT duetime.unawait_job($1::bigint);

-- name: retry
-- dead -> pending with a fresh set of attempts (attempt = 1), runnable now. last_error is
-- kept so the history of why it died stays visible until the next outcome replaces it.
-- $1: the ids, as for cancel.
UPDATE duetime.jobs
   SET status = 'pending', attempt = 1, run_at = greatest(now(), due_at),
       dispatched_at = NULL, heartbeat_at = NULL, finished_at = NULL, dispatch_epoch = NULL
 WHERE id = ANY($1::bigint[]) AND status = 'dead'
RETURNING *;

-- name: run_now
-- A pending job waiting out its retry back-off becomes runnable now (never before its
-- due_at: the table's CHECK, and the partition it lives in, are fixed by due_at).
UPDATE duetime.jobs
   SET run_at = greatest(now(), due_at)
 WHERE id = $1 AND status = 'pending' AND coalesce(run_at, due_at) > now()
   AND due_at <= now()
RETURNING *;

-- name: matching
-- Bulk actions by filter (JobFilter): how many jobs in the states {states} match, the
-- newest id among them and the statement's time (as_of): together they pin the set the
-- operator confirms (matching_ids), so jobs that arrive, or die, between the preview and
-- the confirmation are left alone. {states} is spliced in by JobStore from a fixed set
-- (jobs.BULK_SOURCE: status = 'pending' OR 'dispatched' OR 'waiting' for a cancel, status
-- = 'dead' for a retry), never from outside: as literals they let PostgreSQL use the
-- partial indexes of those states (jobs_pending_run_idx, jobs_dispatched_idx,
-- jobs_waiting_idx, jobs_dead_finished_idx; a BitmapOr for several) instead of reading
-- every row.
SELECT count(*) AS n, max(id) AS max_id, now() AS as_of
  FROM duetime.jobs
 WHERE ({states})
{filter}
   AND id <= $7;

-- name: matching_ids
-- One batch of the ids `matching` counted, oldest first, locked until the caller's
-- transition commits: $7 its max_id, $8 the last id of the previous batch (keyset: a
-- row is offered at most once per confirmation, even if it is retried, dies again and
-- matches again meanwhile), $9 the preview's as_of for dead jobs (a job that died after
-- the preview was not shown, so it is not retried; NULL for a cancel: live jobs carry
-- no such time), $10 the batch size.
SELECT id
  FROM duetime.jobs
 WHERE ({states})
{filter}
   AND id <= $7
   AND id > $8
   AND ($9::timestamptz IS NULL OR finished_at <= $9)
 ORDER BY id
 LIMIT $10
   FOR UPDATE;

-- name: copy_jobs
-- bulk_enqueue from a synchronous driver (scheduler.store.sync_jobs): the columns of
-- jobs.BULK_COLUMNS, rows in text format (asyncpg's copy_to_table builds the same).
COPY duetime.jobs (task, payload, due_at, queue, max_attempts, idempotency_key, traceparent)
FROM STDIN (FORMAT text);

-- name: copy_jobs_tagged
-- copy_jobs with jobs.TAGGED_COLUMNS, for a bulk enqueue where any job has tags or meta.
COPY duetime.jobs (task, payload, due_at, queue, max_attempts, idempotency_key, traceparent,
                   tags, meta)
FROM STDIN (FORMAT text);

-- name: notify
SELECT pg_notify('duetime_jobs', '');

-- name: count_by_status
SELECT status, count(*) AS n FROM duetime.jobs GROUP BY status;
