-- Read models of the operations dashboard (scheduler/store/dashboard.py). Statements are
-- bounded by an index or a LIMIT where they can be (bench/dashboard.py times each one
-- at 1M stored jobs); the dashboard's pool also sets a statement_timeout so one that
-- is not cannot pile up. Counts of pending,
-- dispatched and recently dead jobs per queue come from status.sql (`duetime status`).

-- name: pending_probe
-- Pending jobs counted only up to $1 (jobs_pending_run_idx): counting them exactly per
-- queue (status.sql) costs in proportion to the backlog (docs/benchmarks.md, "Notes moved
-- from the SQL"), so above $1 the overview says "at least $1" instead.
SELECT count(*) AS n
  FROM (SELECT 1 FROM duetime.jobs WHERE status = 'pending' LIMIT $1) AS probe;

-- name: table_bytes
-- The heap size of every partition (file sizes, no rows read): decides whether terminal
-- counts are exact (a small table: one GROUP BY) or estimated from the planner's
-- statistics. Bytes, not reltuples, because a partition nobody analyzed yet has none.
SELECT coalesce(sum(pg_relation_size(inhrelid)), 0)::bigint AS bytes
  FROM pg_inherits
 WHERE inhparent = 'duetime.jobs'::regclass;

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

-- name: minute_samples
-- One row per minute of the last $1 with completions (minute 0 is the last 60 s): how
-- many of its latest $2 completions there are and how far apart the oldest and newest of
-- them are (an index-only scan of job_ledger_completed_idx), and the fire lag
-- (dispatched_at - run time) of its latest $3 (one job lookup each).
-- Bounded whatever the rate ($1 x $2 index entries, $1 x $3 job lookups): a minute
-- with fewer than $2 completions is counted exactly, a busier one is estimated from
-- the spacing of its sample (scheduler/dashboard/present.py); counting every ledger row
-- of the hour instead grows with the rate (docs/benchmarks.md, "Notes moved from the SQL").
-- Each lag lookup goes by id (jobs_id_idx per partition); `due_at <= completed_at`
-- prunes the partitions ahead of the completion at run time.
SELECT m.i AS minutes_ago, r.sampled, r.span, coalesce(g.lags, '{}') AS lags
  FROM generate_series(0, $1 - 1) AS m(i)
 CROSS JOIN LATERAL (
        SELECT count(*) AS sampled,
               extract(epoch FROM max(c.completed_at) - min(c.completed_at))::float8 AS span
          FROM (SELECT completed_at
                  FROM duetime.job_ledger
                 WHERE completed_at > now() - make_interval(mins => m.i + 1)
                   AND completed_at <= now() - make_interval(mins => m.i)
                 ORDER BY completed_at DESC
                 LIMIT $2) AS c) AS r
 CROSS JOIN LATERAL (
        SELECT array_agg(j.lag) AS lags
          FROM (SELECT job_id, completed_at
                  FROM duetime.job_ledger
                 WHERE completed_at > now() - make_interval(mins => m.i + 1)
                   AND completed_at <= now() - make_interval(mins => m.i)
                 ORDER BY completed_at DESC
                 LIMIT $3) AS s
         CROSS JOIN LATERAL (
                SELECT extract(epoch FROM jb.dispatched_at - coalesce(jb.run_at, jb.due_at))
                           ::float8 AS lag
                  FROM duetime.jobs AS jb
                 WHERE jb.id = s.job_id AND jb.due_at <= s.completed_at
                   AND jb.dispatched_at IS NOT NULL
                 LIMIT 1) AS j) AS g
 WHERE r.sampled > 0;

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
-- page), for "any state" ($7 NULL), succeeded and cancelled; the filter part is jobs.sql's
-- job_filter ($1..$6). Ordered by jobs_id_idx in every partition (a Merge Append): a page
-- reads about as many entries as it shows when the filter matches often; a rare filter
-- reads further (up to a whole partition that holds no match), bounded by the pool's
-- statement_timeout. A tag filter with few matches (DashboardStore.FEW_MATCHES, counted
-- first by `tag_matches`) orders by `id + 0` instead, which no index provides: the
-- planner then reads the tag index and keeps the page's top rows while sorting, instead
-- of walking every partition's id index to its end when the tag sits in few partitions
-- (docs/benchmarks.md "Tag filter", 10M). The due window prunes partitions.
SELECT *
  FROM duetime.jobs
 WHERE ($7::text IS NULL OR status = $7)
{filter}
   AND ($8::bigint IS NULL OR id < $8)
 ORDER BY {order_id} DESC
 LIMIT $9;

-- name: state_page
-- The jobs of one state in the order of that state's partial index, keyset-paginated
-- after ($7, $8) = the previous page's last (key, id); the filter part as for jobs_page.
-- DashboardStore makes one statement per state from this text (PAGE_BY_STATE), with the
-- state as a literal and the key written exactly as its index's expression, so each is
-- planned on its own index (ordering by id instead read whole partitions of finished
-- rows: docs/benchmarks.md, "Notes moved from the SQL"):
--   pending     soonest runnable first   coalesce(run_at, due_at)   jobs_pending_run_idx
--   dead        most recently dead first  finished_at DESC          jobs_dead_finished_idx
--   dispatched  longest silent first (what the reconciler rescues next)
--                                  coalesce(heartbeat_at, dispatched_at)  jobs_dispatched_idx
-- The comparison after the key is > for an ascending key, < for a descending one.
SELECT *
  FROM duetime.jobs
 WHERE status = '{status}'
{filter}
   AND ($7::timestamptz IS NULL OR {key} {after}= $7)
   AND ($7::timestamptz IS NULL OR {key} {after} $7 OR id {after} $8)
 ORDER BY {key} {order}, id {order}
 LIMIT $9;

-- name: ledger_row
SELECT idempotency_key, job_id, attempt, task, worker, completed_at
  FROM duetime.job_ledger
 WHERE idempotency_key = $1;

-- name: schedule_name
SELECT name FROM duetime.schedules WHERE id = $1;

-- name: tag_matches
-- How many jobs hold every tag of $1, counted up to $2 from the tag index (migration
-- 0022): a LIMIT under the Append stops at the first buckets for a common tag, and a
-- rare one reads only small index entries. Decides how DashboardStore pages a tag filter.
SELECT count(*)
  FROM (SELECT 1 FROM duetime.jobs
         WHERE cardinality(tags) > 0 AND tags @> $1::text[]
         LIMIT $2) AS found;
