-- Read-only views for `duetime status` and readiness checks (scheduler/store/status.py).
-- All run in one REPEATABLE READ, READ ONLY transaction so the figures agree.
-- Ages are computed by the database (now()), so a skewed clock on the host running
-- `duetime status` cannot make a healthy leader look stale.

-- name: ping
SELECT 1;

-- name: now
SELECT now();

-- name: fence
SELECT epoch, leader_node, elected_at, renewed_at,
       extract(epoch FROM now() - elected_at)::float8 AS elected_age,
       extract(epoch FROM now() - renewed_at)::float8 AS renewed_age
  FROM duetime.leader_fence WHERE shard = 0;

-- name: pending_by_queue
-- Pending rows only: served by the partial index jobs_pending_run_idx (the run time
-- expression is the same as the index's). The redundant due_at <= now() in the FILTERs
-- is true whenever the run time has passed (run_at >= due_at).
SELECT queue,
       count(*) AS pending,
       count(*) FILTER (WHERE coalesce(run_at, due_at) <= now()) AS due_now,
       extract(epoch FROM now() - min(coalesce(run_at, due_at))
           FILTER (WHERE coalesce(run_at, due_at) <= now()))::float8 AS oldest_overdue
  FROM duetime.jobs
 WHERE status = 'pending'
 GROUP BY queue;

-- name: dispatched_by_queue
SELECT queue, count(*) AS dispatched
  FROM duetime.jobs
 WHERE status = 'dispatched'
 GROUP BY queue;

-- name: unstarted_by_queue
-- Dispatched jobs no worker has shown a sign of life for (heartbeat_at IS NULL), per
-- queue, and how long ago the oldest of them was (last) dispatched. Served by the
-- partial index jobs_dispatched_idx (status = 'dispatched'). A handler's first heartbeat
-- comes visibility_timeout/3 after it started, so a job running for less than that is
-- counted too; the reconciler's re-publish restarts dispatched_at, but it defers queues
-- that still hold ready messages, which is the case when nobody consumes them.
SELECT queue,
       count(*) AS unstarted,
       extract(epoch FROM now() - min(dispatched_at))::float8 AS oldest_unstarted
  FROM duetime.jobs
 WHERE status = 'dispatched' AND heartbeat_at IS NULL
 GROUP BY queue;

-- name: dead_by_queue
-- Jobs that went dead within $1 seconds. Without an index on finished_at this reads
-- every partition; a partial index (finished_at) WHERE status = 'dead' makes it cheap.
SELECT queue, count(*) AS dead
  FROM duetime.jobs
 WHERE status = 'dead' AND finished_at >= now() - make_interval(secs => $1)
 GROUP BY queue;

-- name: queues_table
SELECT to_regclass('duetime.queues') IS NOT NULL AS present;

-- name: declared_queues
-- The queues an operator declared (migration 0008; check queues_table first).
SELECT coalesce(array_agg(name), '{}') AS names FROM duetime.queues;

-- name: paused_queues
-- The declared queues an operator paused (`duetime queues pause`): nothing new of them
-- is dispatched.
SELECT coalesce(array_agg(name), '{}') AS names FROM duetime.queues WHERE paused;

-- name: schedules_table
SELECT to_regclass('duetime.schedules') IS NOT NULL AS present;

-- name: schedules_summary
SELECT count(*) AS total,
       count(*) FILTER (WHERE paused) AS paused,
       min(next_fire_at) FILTER (WHERE NOT paused) AS next_fire_at
  FROM duetime.schedules;

-- name: schedules_next
-- The schedules that fire soonest (name and time) for the human view.
SELECT name, next_fire_at,
       extract(epoch FROM next_fire_at - now())::float8 AS fires_in
  FROM duetime.schedules
 WHERE NOT paused AND next_fire_at IS NOT NULL
 ORDER BY next_fire_at
 LIMIT $1;

-- name: waiting
-- Jobs waiting for their dependencies (migration 0025): a count over the partial index
-- jobs_waiting_idx; NULL before the migration (no such index: the status is unknown).
SELECT CASE WHEN to_regclass('duetime.jobs_waiting_idx') IS NULL THEN NULL
            ELSE (SELECT count(*) FROM duetime.jobs WHERE status = 'waiting') END;
