-- The worker's side of duetime.jobs and duetime.job_ledger (DESIGN §6; workers/executor.py).
-- Every statement matches (id, due_at): the pair is the primary key, and due_at (carried
-- in the message) prunes the lookup to one partition. Outcome updates also match
-- status = 'dispatched' AND attempt, so a stale or duplicate delivery can never
-- overwrite a newer attempt's outcome. Why due_at is matched as
-- `$2::timestamptz + interval '0'` (generic plans that still prune): docs/benchmarks.md,
-- "Worker statements and plan caching".
--
-- Every statement here is safe to run with job id 0 (matches nothing, changes nothing):
-- the worker prepares them all that way when a pooled connection opens.

-- name: begin_deliveries
-- First statement for a batch of deliveries that arrived together, in autocommit. For each
-- (id, due_at) it returns the row as it is *after* any in-flight claim: FOR KEY SHARE waits
-- for the dispatcher's claim transaction (it publishes before it commits) and is released
-- when this statement ends. The row is authoritative: task and payload are read here, in
-- the statement that locks the row, never taken from the message. `key` is the job's
-- ledger key, duetime.effective_key() (migration 0007: a producer's key scoped by
-- created_by, else 'job:<id>', a schedule's own key as written), the twin of
-- scheduler.messages.effective_key, computed here so the ledger check runs in this
-- statement (the two are checked to agree by tests/integration/test_effective_key.py).
-- `done` says the ledger already holds it (the
-- effect was applied by an earlier delivery). `epoch` is the row's dispatch_epoch: the
-- worker runs a delivery only when its message carries that epoch (a copy from another
-- dispatch is stale). `i` is the position in the input arrays; missing jobs return no row.
SELECT w.i, j.status, j.attempt, j.max_attempts, j.queue, j.task, j.payload,
       j.effective_key AS key, j.run_time, j.dispatch_epoch AS epoch,
       EXISTS (SELECT 1 FROM duetime.job_ledger l WHERE l.idempotency_key = j.effective_key)
           AS done
  FROM unnest($1::bigint[], $2::timestamptz[]) WITH ORDINALITY AS w(id, due_at, i)
 CROSS JOIN LATERAL (
        -- LATERAL: one primary-key lookup per delivery, pruned to its partition at run
        -- time, whatever the statistics say (a join let the planner scan whole buckets)
        SELECT status, attempt, max_attempts, queue, task, payload, dispatch_epoch,
               duetime.effective_key(id, idempotency_key, schedule_id, created_by)
                   AS effective_key,
               coalesce(run_at, due_at) AS run_time
          FROM duetime.jobs
         WHERE id = w.id AND due_at = w.due_at
           FOR KEY SHARE
       ) j;

-- name: complete_deliveries
-- Batched completion of attempts whose handler never used ctx.db (and of duplicates whose
-- key the ledger already holds): one statement, one commit, for the whole batch. The ledger
-- rows and the succeeded updates commit together; a key already in the ledger (an earlier
-- delivery, or another job with the same key) inserts nothing and the job is still
-- settled as succeeded. Returns the ids that were still this attempt's and dispatched.
WITH done AS (
    SELECT * FROM unnest($1::bigint[], $2::timestamptz[], $3::int[], $4::text[], $5::text[])
        AS d(id, due_at, attempt, key, task)
), settled AS (
    -- the `= ANY` predicates repeat the join's on purpose: they give the planner a
    -- primary-key index scan pruned to the batch's partitions, instead of a hash join
    -- over whole buckets when statistics are thin
    UPDATE duetime.jobs j
       SET status = 'succeeded', finished_at = now()
      FROM done d
     WHERE j.id = ANY($1::bigint[]) AND j.due_at = ANY($2::timestamptz[])
       AND j.id = d.id AND j.due_at = d.due_at
       AND j.status = 'dispatched' AND j.attempt = d.attempt
    RETURNING j.id, d.attempt, d.key, d.task
), ledger AS (
    INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker)
    SELECT s.key, s.id, s.attempt, s.task, $6 FROM settled s
    ON CONFLICT (idempotency_key) DO NOTHING
)
SELECT coalesce(array_agg(id), '{}') FROM settled;

-- name: finish_attempt
-- Last statement of an attempt whose handler used ctx.db, inside that transaction: the job
-- becomes succeeded and the ledger row is inserted, atomically with the handler's own
-- writes (duetime.finish_attempt, migration 0009: SQLSTATE DT001 when the row moved on,
-- DT002 when the key is already in the ledger; either aborts the transaction). It is
-- sent with its COMMIT in one round trip, as simple-protocol text, so its arguments are
-- literals: {id} and {attempt} are integers, the others quoted by
-- ExecutionStore.finish_statement.
SELECT duetime.finish_attempt({id}, {due_at}::timestamptz, {attempt}, {key}, {task}, {worker});

-- name: schedule_retry
-- Back to pending with the next attempt, runnable after $4 seconds (never before due_at,
-- the table's CHECK). The delay is bounded by workers.retry.MAX_RETRY_DELAY before it gets
-- here; least() is the second bound, so no value can overflow make_interval.
-- dispatched_at/heartbeat_at are cleared so the reconciler's "no sign of life" clock
-- starts again at the next dispatch. $6 is the worker's attempt budgets, a JSON object
-- task -> max_attempts of the tasks registered with one (workers.registry): the budget
-- that applied is written to max_attempts, so "attempt n of m" tells the truth (no entry:
-- the row's own number applied and stays).
UPDATE duetime.jobs
   SET status = 'pending', attempt = attempt + 1,
       run_at = greatest(now() + make_interval(secs => least($4::float8, 31622400)), due_at),
       last_error = $5, dispatched_at = NULL, heartbeat_at = NULL, dispatch_epoch = NULL,
       max_attempts = coalesce(($6::text::jsonb ->> task)::int, max_attempts)
 WHERE id = $1 AND due_at = $2::timestamptz + interval '0'
   AND status = 'dispatched' AND attempt = $3
RETURNING run_at;

-- name: mark_dead
-- $5: the attempt budgets, as in schedule_retry.
UPDATE duetime.jobs
   SET status = 'dead', finished_at = now(), last_error = $4, heartbeat_at = NULL,
       max_attempts = coalesce(($5::text::jsonb ->> task)::int, max_attempts)
 WHERE id = $1 AND due_at = $2::timestamptz + interval '0'
   AND status = 'dispatched' AND attempt = $3
RETURNING 1;

-- name: heartbeat
-- Autocommit, on its own connection: a sign of life for the reconciler. No row means the
-- job is no longer this attempt's (finished or superseded).
UPDATE duetime.jobs
   SET heartbeat_at = now()
 WHERE id = $1 AND due_at = $2::timestamptz + interval '0'
   AND status = 'dispatched' AND attempt = $3
RETURNING 1;

-- name: finish_group
-- finish_delivery for every attempt of a transaction group (workers/groups.py), inside
-- the group's transaction, then COMMIT. The group holds at most one attempt per key, so
-- `recorded` can be read per key. Results are aligned with the input by `i`.
WITH done AS (
    SELECT * FROM unnest($1::bigint[], $2::timestamptz[], $3::int[], $4::text[], $5::text[])
        WITH ORDINALITY AS d(id, due_at, attempt, key, task, i)
), settled AS (
    -- `id = ANY` repeats the join for a primary-key index scan; the due_at range ($7, $8:
    -- the smallest and largest due_at) prunes to the group's partitions at executor
    -- start. `+ interval '0'` keeps plan-time pruning from making custom plans look
    -- cheaper (this runs on a handler's connection, with PostgreSQL's default plan cache
    -- mode): see docs/benchmarks.md, "Worker statements and plan caching".
    UPDATE duetime.jobs j
       SET status = 'succeeded', finished_at = now()
      FROM done d
     WHERE j.id = ANY($1::bigint[])
       AND j.due_at >= $7::timestamptz + interval '0'
       AND j.due_at <= $8::timestamptz + interval '0'
       AND j.id = d.id AND j.due_at = d.due_at
       AND j.status = 'dispatched' AND j.attempt = d.attempt
    RETURNING d.i, d.id, d.attempt, d.key, d.task
), ledger AS (
    INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker)
    SELECT s.key, s.id, s.attempt, s.task, $6 FROM settled s
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key
)
SELECT d.i,
       EXISTS (SELECT 1 FROM settled s WHERE s.i = d.i) AS settled,
       EXISTS (SELECT 1 FROM ledger l WHERE l.idempotency_key = d.key) AS recorded
  FROM done d
 ORDER BY d.i;
