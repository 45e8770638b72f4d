-- Statements of `duetime demo` (demo/store.py). The demo database is its own,
-- dropped and re-created at every run, so these read whole tables without filters
-- beyond the run's queue.

-- name: drop_database
-- {database} is validated by store.validate_database_name (letters, digits, '_').
DROP DATABASE IF EXISTS "{database}" WITH (FORCE);

-- name: create_database
CREATE DATABASE "{database}";

-- name: create_effects
-- One row per handler run that committed. No unique constraint on purpose: the demo
-- counts duplicate effects instead of letting an error hide them.
CREATE TABLE IF NOT EXISTS public.demo_effects (
    id         bigserial   PRIMARY KEY,
    kind       text        NOT NULL CHECK (kind IN ('job', 'cron')),
    seq        integer,
    schedule   text,
    job_id     bigint      NOT NULL,
    attempt    integer     NOT NULL,
    due_at     timestamptz NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    worker     text
);
CREATE INDEX IF NOT EXISTS demo_effects_kind_seq ON public.demo_effects (kind, seq);

-- name: record_effect
INSERT INTO public.demo_effects (kind, seq, schedule, job_id, attempt, due_at, worker)
VALUES ($1, $2, $3, $4, $5, $6, $7);

-- name: now
SELECT clock_timestamp();

-- name: fence
-- As status.sql's `fence`, with ages by clock_timestamp() like the demo's `now`.
SELECT epoch, leader_node, elected_at, renewed_at,
       extract(epoch FROM clock_timestamp() - elected_at)::float8 AS elected_age,
       extract(epoch FROM clock_timestamp() - renewed_at)::float8 AS renewed_age
  FROM duetime.leader_fence WHERE shard = 0;

-- name: job_counts
-- The run's one-shot jobs by status. "fired" = handed to the broker at least once.
SELECT count(*)                                           AS total,
       count(*) FILTER (WHERE status = 'pending')         AS pending,
       count(*) FILTER (WHERE status = 'dispatched')      AS dispatched,
       count(*) FILTER (WHERE status = 'succeeded')       AS succeeded,
       count(*) FILTER (WHERE status = 'dead')            AS dead,
       count(*) FILTER (WHERE status = 'cancelled')       AS cancelled,
       count(*) FILTER (WHERE dispatched_at IS NOT NULL)  AS fired
  FROM duetime.jobs
 WHERE queue = $1 AND task = $2;

-- name: job_effects
-- Effects of one-shot jobs: how many, how many distinct jobs, and the lag (handler
-- start - due_at, seconds). $1/$2 (both NULL: none) is the failover gap (the leader's
-- kill .. the new leader's first dispatch): jobs due before its end that started after
-- its beginning waited for the failover and are left out, to show the steady-state lag
-- next to the overall one.
SELECT count(*)                                                    AS effects,
       count(DISTINCT seq)                                         AS distinct_jobs,
       percentile_cont(0.5)  WITHIN GROUP (ORDER BY lag)           AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY lag)           AS p99,
       max(lag)                                                    AS max
  FROM (SELECT seq, extract(epoch FROM started_at - due_at)::float8 AS lag
          FROM public.demo_effects
         WHERE kind = 'job'
           AND ($1::timestamptz IS NULL OR NOT (due_at <= $2 AND started_at >= $1))) AS e;

-- name: effects_by_worker
SELECT coalesce(worker, '?') AS worker, count(*) AS effects
  FROM public.demo_effects
 GROUP BY 1
 ORDER BY 1;

-- name: cron_effects
-- Per schedule: effects, distinct nominal fire times (a difference is a duplicate), lag.
SELECT schedule,
       count(*)                                                    AS effects,
       count(DISTINCT due_at)                                      AS distinct_fires,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY lag)            AS p50,
       max(lag)                                                    AS max
  FROM (SELECT schedule, due_at, extract(epoch FROM started_at - due_at)::float8 AS lag
          FROM public.demo_effects WHERE kind = 'cron') AS c
 GROUP BY schedule
 ORDER BY schedule;

-- name: first_dispatch
-- When the leader of epoch $1 first handed one of the run's jobs to the broker.
SELECT min(dispatched_at) FROM duetime.jobs WHERE dispatch_epoch = $1 AND queue = $2;
