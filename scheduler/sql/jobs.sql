-- Client API on duetime.jobs: enqueue, read, list, cancel, retry (DESIGN §3).
-- The dispatcher's and the worker's transitions live in dispatch.sql / execution.sql.

-- name: insert
INSERT INTO duetime.jobs (task, payload, due_at, queue, max_attempts, idempotency_key)
VALUES ($1, $2, coalesce($3, now()), $4, $5, $6)
RETURNING *;

-- name: get
SELECT * FROM duetime.jobs WHERE id = $1;

-- name: list
-- Keyset pagination on id: stable and complete while rows are inserted concurrently.
SELECT * FROM duetime.jobs
 WHERE ($1::text IS NULL OR status = $1)
   AND ($2::text IS NULL OR queue = $2)
   AND ($3::text IS NULL OR task = $3)
   AND ($4::timestamptz IS NULL OR due_at >= $4)
   AND ($5::timestamptz IS NULL OR due_at < $5)
   AND ($6::bigint IS NULL OR id > $6)
 ORDER BY id
 LIMIT $7;

-- name: cancel
UPDATE duetime.jobs
   SET status = 'cancelled', finished_at = now()
 WHERE id = $1 AND status = 'pending'
RETURNING *;

-- name: retry
-- dead -> pending with a fresh set of attempts (attempt = 1), runnable now. last_error is
-- kept so the history of why it died stays visible until the next outcome replaces it.
UPDATE duetime.jobs
   SET status = 'pending', attempt = 1, run_at = greatest(now(), due_at),
       dispatched_at = NULL, heartbeat_at = NULL, finished_at = NULL, dispatch_epoch = NULL
 WHERE id = $1 AND status = 'dead'
RETURNING *;

-- name: notify
SELECT pg_notify('duetime_jobs', '');

-- name: count_by_status
SELECT status, count(*) AS n FROM duetime.jobs GROUP BY status;
