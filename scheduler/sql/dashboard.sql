-- Read models of the operations dashboard (scheduler/store/dashboard.py). Every statement
-- is bounded by an index or a LIMIT, so a page costs milliseconds at 10M stored jobs
-- (bench/dashboard.py measures each one); the dashboard's pool also sets a
-- statement_timeout so a statement that is not cannot pile up. Counts of pending,
-- dispatched and recently dead jobs per queue come from status.sql (`duetime status`).

-- name: table_probe
-- How many rows exist, counted only up to $1: decides whether terminal counts are exact
-- (a small table: one GROUP BY) or estimated from the planner's statistics.
SELECT count(*) AS n FROM (SELECT 1 FROM duetime.jobs LIMIT $1) AS probe;

-- name: terminal_counts
-- Exact, for a table the probe found small.
SELECT queue, status, count(*) AS n
  FROM duetime.jobs
 WHERE status IN ('succeeded', 'dead', 'cancelled')
 GROUP BY queue, status;

-- name: terminal_estimates
-- Estimated per state from each partition's statistics (ANALYZE, which autovacuum runs):
-- reltuples x the state's frequency among the most common values. Reads only catalogs,
-- so it costs the same at 10M rows as at 10k; a partition never analyzed counts as 0.
SELECT v.status, round(sum(c.reltuples * v.freq))::bigint AS n
  FROM pg_inherits AS i
  JOIN pg_class AS c ON c.oid = i.inhrelid
  JOIN pg_namespace AS ns ON ns.oid = c.relnamespace
  JOIN pg_stats AS s
    ON s.schemaname = ns.nspname AND s.tablename = c.relname
   AND s.attname = 'status' AND NOT s.inherited
 CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs)
       AS v(status, freq)
 WHERE i.inhparent = 'duetime.jobs'::regclass
   AND c.reltuples > 0
   AND v.status IN ('succeeded', 'dead', 'cancelled')
 GROUP BY v.status;

-- name: oldest_overdue
-- The pending job that has been due longest (jobs_pending_run_idx, like the claim).
SELECT *, extract(epoch FROM now() - coalesce(run_at, due_at))::float8 AS late
  FROM duetime.jobs
 WHERE status = 'pending'
   AND coalesce(run_at, due_at) <= now()
   AND due_at <= now()
 ORDER BY coalesce(run_at, due_at)
 LIMIT 1;

-- name: latest_dead
-- The newest jobs that went dead within $1 seconds (jobs_dead_finished_idx).
SELECT *
  FROM duetime.jobs
 WHERE status = 'dead' AND finished_at >= now() - make_interval(secs => $1)
 ORDER BY finished_at DESC
 LIMIT $2;

-- name: throughput
-- Completions (ledger rows) per minute over the last $1 minutes; minute 0 is the
-- current one. An index-only scan of job_ledger_completed_idx: its cost grows with the
-- completions in the window (~720k at 200 jobs/s), not with the table.
SELECT floor(extract(epoch FROM now() - completed_at) / 60)::int AS minutes_ago,
       count(*) AS n
  FROM duetime.job_ledger
 WHERE completed_at > now() - make_interval(mins => $1)
 GROUP BY 1;

-- name: lag_sample
-- Fire lag (dispatched_at - run time) of up to $2 of the latest completions in each of
-- the last $1 minutes: an even sample of the hour whatever the rate, so a busy minute
-- cannot crowd out the others and the cost is bounded ($1 x $2 lookups). Each lookup
-- goes by id (jobs_id_idx per partition); `due_at <= completed_at` prunes the
-- partitions ahead of the completion at run time.
SELECT m.i AS minutes_ago, j.lag
  FROM generate_series(0, $1 - 1) AS m(i)
 CROSS JOIN LATERAL (
        SELECT l.job_id, l.completed_at
          FROM duetime.job_ledger AS l
         WHERE l.completed_at > now() - make_interval(mins => m.i + 1)
           AND l.completed_at <= now() - make_interval(mins => m.i)
         ORDER BY l.completed_at DESC
         LIMIT $2) AS s
 CROSS JOIN LATERAL (
        SELECT extract(epoch FROM jb.dispatched_at - coalesce(jb.run_at, jb.due_at))::float8
                   AS lag
          FROM duetime.jobs AS jb
         WHERE jb.id = s.job_id AND jb.due_at <= s.completed_at
           AND jb.dispatched_at IS NOT NULL
         LIMIT 1) AS j;

-- name: workers
-- Workers that completed a job within $1 seconds (the ledger's worker column is the
-- worker's node id).
SELECT coalesce(worker, '?') AS worker, count(*) AS completed, max(completed_at) AS last_seen,
       extract(epoch FROM now() - max(completed_at))::float8 AS age
  FROM duetime.job_ledger
 WHERE completed_at > now() - make_interval(secs => $1)
 GROUP BY 1
 ORDER BY 1;

-- name: jobs_page
-- The job list, newest first, keyset-paginated on id ($7: the last id of the previous
-- page). Ordered by jobs_id_idx in every partition (a Merge Append), so a page reads
-- about as many index entries as it shows rows for common filters; the due window
-- prunes partitions at executor start. A rare filter over many rows reads further,
-- bounded by the pool's statement_timeout.
SELECT *
  FROM duetime.jobs
 WHERE ($1::text IS NULL OR status = $1)
   AND ($2::text IS NULL OR queue = $2)
   AND ($3::text IS NULL OR task = $3)
   AND ($4::timestamptz IS NULL OR due_at >= $4)
   AND ($5::timestamptz IS NULL OR due_at < $5)
   AND ($6::text IS NULL OR strpos(lower(last_error), lower($6)) > 0)
   AND ($7::bigint IS NULL OR id < $7)
 ORDER BY id DESC
 LIMIT $8;

-- name: ledger_row
SELECT idempotency_key, job_id, attempt, task, worker, completed_at
  FROM duetime.job_ledger
 WHERE idempotency_key = $1;

-- name: schedule_name
SELECT name FROM duetime.schedules WHERE id = $1;
