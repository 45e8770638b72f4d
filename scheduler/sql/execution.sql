-- The worker's side of duetime.jobs and duetime.job_ledger (DESIGN §6).
-- Every statement matches (id, due_at): the pair is the primary key, and due_at (carried
-- in the message) prunes the lookup to one partition. Outcome updates also match
-- status = 'dispatched' AND attempt = $3, so a stale or duplicate delivery can never
-- overwrite a newer attempt's outcome.
--
-- due_at is matched as `$2::timestamptz + interval '0'`, which is $2 itself, on purpose:
-- `timestamptz + interval` is only STABLE, so no plan can prune partitions on it at plan
-- time and a custom plan is no cheaper than the generic one; asyncpg's prepared
-- statements then settle on the generic plan, pruned at executor start ("Subplans
-- Removed"). With a plain `due_at = $2` PostgreSQL keeps choosing custom plans (they
-- prune, so they look cheaper) and re-plans every execution: measured (bench/worker
-- statements, 32 connections, 17 partitions) 590 → 415 µs of server CPU per delivery,
-- +35 % deliveries/s; with 57 partitions 545 → 475 µs. The plan-cache setting
-- (plan_cache_mode) would do the same for the whole session, including handlers' own
-- statements on ctx.db: not ours to change.

-- name: lock_job
-- First statement of every delivery's transaction. FOR KEY SHARE waits for the
-- dispatcher's claim transaction (it publishes before it commits), so the worker sees
-- the claim's committed outcome; held while the handler runs, it makes the reconciler's
-- FOR UPDATE SKIP LOCKED leave an executing job alone, while heartbeats (FOR NO KEY
-- UPDATE) do not conflict with it.
SELECT status, attempt, max_attempts, queue, idempotency_key,
       coalesce(run_at, due_at) AS run_time
  FROM duetime.jobs
 WHERE id = $1 AND due_at = $2::timestamptz + interval '0'
   FOR KEY SHARE;

-- name: begin_delivery
-- First statement of a delivery's transaction for a registered task: lock_job and the
-- ledger row in one round trip. The `job` CTE is lock_job (it waits for the claim
-- the same way); the ledger row is inserted only when the locked row is this attempt,
-- still dispatched, under the row's own key ($4 when it has none). `claimed_key` is the
-- key when this delivery inserted it, NULL when the ledger already held it (a duplicate)
-- or when no insert was due (missing/stale: then status/attempt tell why). No row: the
-- job does not exist. A concurrent duplicate delivery blocks on the ledger's primary key
-- until the first one's transaction ends, then inserts nothing.
WITH job AS (
    SELECT status, attempt, max_attempts, queue, idempotency_key,
           coalesce(run_at, due_at) AS run_time
      FROM duetime.jobs
     WHERE id = $1 AND due_at = $2::timestamptz + interval '0'
       FOR KEY SHARE
), ledger AS (
    INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker)
    SELECT coalesce(nullif(job.idempotency_key, ''), $4), $1, $3, $5, $6
      FROM job
     WHERE job.status = 'dispatched' AND job.attempt = $3
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key
)
SELECT job.status, job.attempt, job.max_attempts, job.queue, job.idempotency_key,
       job.run_time, (SELECT idempotency_key FROM ledger) AS claimed_key
  FROM job;

-- name: mark_succeeded
-- Also settles a duplicate whose key the ledger already holds. last_error is kept: it
-- says why earlier attempts failed.
UPDATE duetime.jobs
   SET status = 'succeeded', finished_at = now()
 WHERE id = $1 AND due_at = $2::timestamptz + interval '0'
   AND status = 'dispatched' AND attempt = $3
RETURNING 1;

-- name: schedule_retry
-- Back to pending with the next attempt, runnable after $4 seconds (never before due_at,
-- the table's CHECK). dispatched_at/heartbeat_at are cleared so the reconciler's
-- "no sign of life" clock starts again at the next dispatch.
UPDATE duetime.jobs
   SET status = 'pending', attempt = attempt + 1,
       run_at = greatest(now() + make_interval(secs => $4::float8), due_at),
       last_error = $5, dispatched_at = NULL, heartbeat_at = NULL, dispatch_epoch = NULL
 WHERE id = $1 AND due_at = $2::timestamptz + interval '0'
   AND status = 'dispatched' AND attempt = $3
RETURNING run_at;

-- name: mark_dead
UPDATE duetime.jobs
   SET status = 'dead', finished_at = now(), last_error = $4, heartbeat_at = NULL
 WHERE id = $1 AND due_at = $2::timestamptz + interval '0'
   AND status = 'dispatched' AND attempt = $3
RETURNING 1;

-- name: heartbeat
-- Autocommit, on its own connection: a sign of life for the reconciler. Takes FOR NO KEY
-- UPDATE on the row, which does not conflict with the executing transaction's FOR KEY
-- SHARE. No row means the job is no longer this attempt's (finished or superseded).
UPDATE duetime.jobs
   SET heartbeat_at = now()
 WHERE id = $1 AND due_at = $2::timestamptz + interval '0'
   AND status = 'dispatched' AND attempt = $3
RETURNING 1;
