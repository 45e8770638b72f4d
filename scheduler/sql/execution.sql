-- The worker's side of duetime.jobs and duetime.job_ledger (DESIGN §6; workers/executor.py).
-- Every statement is a call of a SECURITY DEFINER function of migration 0009: the worker
-- role holds no privilege on either table, and each function allows one transition of a
-- row that is `dispatched` at the attempt named (docs/security.md, "The worker settles
-- only dispatched attempts"). Ledger rows are derived from the row being settled. Inside
-- the functions every statement matches (id, due_at): the pair is the primary key, and
-- due_at (carried in the message) prunes the lookup to one partition; the `+ interval '0'`
-- idiom of docs/benchmarks.md, "Worker statements and plan caching", is kept there.
--
-- Every statement here is safe to run with job id 0 (matches nothing, changes nothing):
-- the worker prepares them all that way when a pooled connection opens.

-- name: begin_deliveries
-- First statement for a batch of deliveries that arrived together, in autocommit. For each
-- (id, due_at) it returns the row as it is *after* any in-flight claim: FOR KEY SHARE waits
-- for the dispatcher's claim transaction (it publishes before it commits) and is released
-- when this statement ends. The row is authoritative: task and payload are read here, in
-- the statement that locks the row, never taken from the message. `key` is the job's
-- ledger key, duetime.effective_key() (migration 0007), the twin of
-- scheduler.messages.effective_key (tests/integration/test_effective_key.py). `done` says
-- the ledger already holds it (the effect was applied by an earlier delivery). `epoch` is
-- the row's dispatch_epoch: the worker runs a delivery only when its message carries that
-- epoch (a copy from another dispatch is stale). `started` (migration 0012): this
-- session took the attempt's guard lock and may run it (true), another session holds it
-- (false: a copy of a running attempt), or the row is not the message's to run (NULL).
-- Runs on the executor's guard connection, which holds the locks it takes until they are
-- released: $5-$7 are attempts whose guards this session releases first (those settled
-- since the last statement), else release_guards. `i` is the position in the input
-- arrays; missing jobs return no row. `timeout_s` (migration 0019): the job's own time
-- limit, NULL for the task's. `traceparent` and `enqueued_at` (migration 0023): the
-- enqueuing code's trace context and when the job was inserted (scheduler/tracing.py).
-- `dependencies` (migration 0025): the outcomes of the jobs it depends on, a JSON array
-- read in the same statement (ctx.dependencies); NULL for a job without depends_on.
SELECT i, status, attempt, max_attempts, queue, task, payload, key, run_time, done, epoch,
       started, timeout_s, traceparent, enqueued_at, dependencies
  FROM duetime.worker_begin_flow($1::bigint[], $2::timestamptz[], $3::int[], $4::bigint[],
                                 $5::bigint[], $6::int[], $7::bigint[]);

-- name: release_guards
-- On the guard connection, after the attempts' outcomes committed (or when they ended
-- without one): their guard locks are released, so a later copy finds the row settled,
-- or, when nothing was settled, may run it.
SELECT duetime.worker_release($1::bigint[], $2::int[], $3::bigint[]);

-- name: complete_deliveries
-- Batched completion of attempts whose handler never used ctx.db (and of duplicates whose
-- key the ledger already holds): one statement, one commit, for the whole batch. The ledger
-- rows and the succeeded updates commit together; a key already in the ledger (an earlier
-- delivery, or another job with the same key) inserts nothing and the job is still
-- settled as succeeded. Returns the ids that were still this attempt's and dispatched.
-- $5: each attempt's result as JSON text (migration 0019), NULL for none.
SELECT duetime.worker_complete($1::bigint[], $2::timestamptz[], $3::int[], $4::text,
                               $5::text[]::jsonb[]);

-- name: finish_attempt
-- Last statement of an attempt whose handler used ctx.db, inside that transaction: the job
-- becomes succeeded and the ledger row is inserted, atomically with the handler's own
-- writes (duetime.finish_attempt, migration 0009: SQLSTATE DT001 when the row moved on,
-- DT002 when the key is already in the ledger; either aborts the transaction). It is
-- sent with its COMMIT in one round trip, as simple-protocol text, so its arguments are
-- literals: {id} and {attempt} are integers, the others quoted by
-- ExecutionStore.finish_statement; {result} is the handler's result (a quoted JSON text)
-- or NULL (migration 0019).
SELECT duetime.finish_attempt({id}, {due_at}::timestamptz, {attempt}, {worker},
                              {result}::jsonb);

-- name: schedule_retry
-- Back to pending with the next attempt, runnable after $4 seconds (never before due_at,
-- the table's CHECK). The delay is bounded by workers.retry.MAX_RETRY_DELAY before it gets
-- here and again in the function, so no value can overflow make_interval.
-- dispatched_at/heartbeat_at are cleared so the reconciler's "no sign of life" clock
-- starts again at the next dispatch. $6 is the worker's attempt budgets, a JSON object
-- task -> max_attempts of the tasks registered with one (workers.registry): the budget
-- that applied is written to max_attempts, so "attempt n of m" tells the truth (no entry:
-- the row's own number applied and stays). NULL when the row is no longer this attempt's.
SELECT duetime.worker_retry($1::bigint, $2::timestamptz, $3::int, $4::float8, $5::text,
                            $6::text);

-- name: mark_dead
-- $5: the attempt budgets, as in schedule_retry. 1, or NULL when the row moved on.
SELECT duetime.worker_dead($1::bigint, $2::timestamptz, $3::int, $4::text, $5::text);

-- name: heartbeat
-- Autocommit, on its own connection: a sign of life for the reconciler. NULL means the
-- job is no longer this attempt's (finished or superseded).
SELECT duetime.worker_heartbeat($1::bigint, $2::timestamptz, $3::int);

-- name: finish_group
-- finish_delivery for every attempt of a transaction group (workers/groups.py), inside
-- the group's transaction, then COMMIT. The group holds at most one attempt per key, so
-- `recorded` can be read per attempt. Results are aligned with the input by `i`; $5 and
-- $6 are the smallest and largest due_at (they prune to the group's partitions); $7 the
-- results, as for complete_deliveries.
SELECT i, settled, recorded
  FROM duetime.worker_finish_group($1::bigint[], $2::timestamptz[], $3::int[], $4::text,
                                   $5::timestamptz, $6::timestamptz, $7::text[]::jsonb[]);

-- name: snooze
-- Back to pending at the same attempt, runnable after $4 seconds (Snooze; migration
-- 0019): the new snooze count, 0 when the job is at its max_snoozes (nothing changed),
-- NULL when the row is no longer this attempt's.
SELECT duetime.worker_snooze($1::bigint, $2::timestamptz, $3::int, $4::float8);

-- name: cancelled
-- Which of the jobs this worker runs are cancelled (workers/cancel.py): the backstop
-- for a cancel NOTIFY lost with a LISTEN connection.
SELECT duetime.worker_cancelled($1::bigint[]);

-- name: progress
-- ctx.progress (workers/progress.py): autocommit, on the worker's own connection, at
-- most a few times a second per job. 1, or NULL when the row is no longer this attempt's.
SELECT duetime.worker_progress($1::bigint, $2::timestamptz, $3::int, $4::real, $5::text);

-- name: unstage
-- A staged job whose row's run time is later than its message's (moved while staged,
-- migration 0028): back to pending for this attempt and dispatch; the ids given back.
SELECT duetime.worker_unstage($1::bigint[], $2::timestamptz[], $3::int[], $4::bigint[]);

-- name: ping
-- Whether the database answers (workers/outage.py): while deliveries of a shard wait
-- out an outage, one probe at a time, at most every 2 s.
SELECT 1;
