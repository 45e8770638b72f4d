-- Concurrency limits (migration 0016; scheduler/store/limits.py, `duetime limits`).
-- The operator's statements first, then the dispatcher's: it reads the limits, counts
-- the dispatched jobs of the limited targets, and claims their due jobs apart from the
-- general claim (docs/architecture.md, "Limits").

-- name: set
-- Insert or change one limit; the CHECKs of migrations 0016 and 0018 refuse a bad target
-- or number (the CLI validates first). $5/$6: the rate's count and period (seconds), or
-- NULL.
INSERT INTO duetime.limits (target, max_running, per_key, fair, rate_count, rate_period)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (target) DO UPDATE
   SET max_running = excluded.max_running, per_key = excluded.per_key,
       fair = excluded.fair, rate_count = excluded.rate_count,
       rate_period = excluded.rate_period, updated_at = now()
RETURNING target;

-- name: remove
DELETE FROM duetime.limits WHERE target = $1 RETURNING target;

-- name: all
-- Every limit, as the dispatcher caches it.
SELECT target, max_running, per_key, fair, rate_count, rate_period
  FROM duetime.limits ORDER BY target;

-- name: list
-- Every limit with its use now: dispatched jobs of its target (the largest per key for a
-- per-key limit), due pending jobs of the target, held or not, and for a rate its starts
-- in the window now (the busiest key's for a per-key rate). One grouped pass over the
-- live rows of the limited tasks and queues; `duetime limits list`, status, dashboard.
WITH live AS (
    SELECT l.target, j.limit_key,
           count(*) FILTER (WHERE j.status = 'dispatched') AS running,
           count(*) FILTER (WHERE j.status = 'pending'
                              AND coalesce(j.run_at, j.due_at) <= now()) AS due
      FROM duetime.limits AS l
      JOIN duetime.jobs AS j
        ON j.status IN ('pending', 'dispatched')
       AND (l.target = 'task:' || j.task OR l.target = 'queue:' || j.queue)
     GROUP BY l.target, j.limit_key
)
SELECT l.target, l.max_running, l.per_key, l.fair, l.rate_count, l.rate_period,
       l.created_at, l.updated_at,
       coalesce(CASE WHEN l.per_key THEN max(v.running) ELSE sum(v.running) END, 0)::bigint
           AS running,
       coalesce(sum(v.due), 0)::bigint AS due,
       (SELECT coalesce(max(w.n), 0)::bigint
          FROM (SELECT sum(s.starts) AS n
                  FROM duetime.limit_starts AS s
                 WHERE s.target = l.target
                   AND s.started_at > statement_timestamp()
                                      - make_interval(secs => l.rate_period)
                 GROUP BY CASE WHEN l.per_key THEN s.limit_key ELSE '' END) AS w)
           AS started
  FROM duetime.limits AS l
  LEFT JOIN live AS v ON v.target = l.target
 GROUP BY l.target
 ORDER BY l.target;

-- name: generic_plans
-- Inside the dispatcher's fenced transaction, around `counts`, `starts` and `claim`
-- (LimitStore.generic_plans): plan them once per connection, not on every execution.
-- With `LIMIT $9` at a small room (a cap of 3 with one slot free) PostgreSQL's generic
-- plan is costed for a tenth of the rows, so it kept custom plans forever: 4 ms of
-- planning over 17 partitions for 0.2 ms of execution, per pass, 13-20 ms under load
-- (docs/benchmarks.md, "A limit that does not bind, and one that does"). The generic plan is
-- the same index scans, pruned at executor start by now().
SET LOCAL plan_cache_mode = force_generic_plan;

-- name: default_plans
-- Back to the session's choice for the rest of the claim transaction.
SET LOCAL plan_cache_mode TO DEFAULT;

-- name: counts
-- Dispatched jobs of the limited tasks ($1) and queues ($2), per task, queue and limit
-- key ('' for none: a key is never empty, jobs_limit_key_invalid). A job counts from the
-- commit that marked it dispatched until the commit of its outcome, so this count is
-- exact inside the dispatcher's fenced transaction: only that transaction makes jobs
-- dispatched, and a count that misses an outcome committing meanwhile is only too high.
-- Reads jobs_dispatched_idx (dispatched rows only: the broker's buffer and running jobs).
SELECT task, queue, coalesce(limit_key, '') AS limit_key, count(*) AS running
  FROM duetime.jobs
 WHERE status = 'dispatched'
   AND (task = ANY($1::text[]) OR queue = ANY($2::text[]))
 GROUP BY 1, 2, 3;

-- name: claim
-- The due jobs of the limited tasks ($1) and queues ($2) of declared queues, except those
-- of targets with no allowance left ($3 tasks, $4 queues, with the queues held for
-- credit) and of the per-key targets' keys with none ($5/$6 task and key, $7/$8 queue and
-- key, in pairs). Highest priority first, then run time; at most $9 rows, locked SKIP
-- LOCKED like the general claim. The caller keeps those the allowances admit
-- (scheduler.duties.limits) and leaves the others pending (their locks end at commit).
-- Parameters, not literals: this runs only while limits exist, and task names and keys
-- are producers' text.
SELECT id, task, queue, due_at, run_at, attempt, coalesce(limit_key, '') AS limit_key
  FROM duetime.jobs AS j
 WHERE status = 'pending'
   AND coalesce(run_at, due_at) <= now()
   AND due_at <= now()
   AND (task = ANY($1::text[]) OR queue = ANY($2::text[]))
   AND task <> ALL($3::text[])
   AND queue <> ALL($4::text[])
   AND (task, coalesce(limit_key, '')) NOT IN (SELECT * FROM unnest($5::text[], $6::text[]))
   AND (queue, coalesce(limit_key, '')) NOT IN (SELECT * FROM unnest($7::text[], $8::text[]))
   AND EXISTS (SELECT 1 FROM duetime.queues AS q WHERE q.name = j.queue)
 ORDER BY priority DESC, coalesce(run_at, due_at)
 LIMIT $9
   FOR UPDATE SKIP LOCKED;

-- name: held
-- Due pending jobs per limited target, tasks $1 and queues $2 (sampled with the backlog
-- for duetime_limit_held). The dispatcher claims every due job a limit admits at once,
-- so these are the jobs the limit holds back (or a full broker buffer does, for a
-- moment). Reads jobs_pending_run_idx, like the backlog count.
SELECT target, count(*) AS jobs
  FROM (SELECT 'task:' || task AS target
          FROM duetime.jobs
         WHERE status = 'pending' AND coalesce(run_at, due_at) <= now() AND due_at <= now()
           AND task = ANY($1::text[])
        UNION ALL
        SELECT 'queue:' || queue
          FROM duetime.jobs
         WHERE status = 'pending' AND coalesce(run_at, due_at) <= now() AND due_at <= now()
           AND queue = ANY($2::text[])) AS due
 GROUP BY target;

-- name: claim_fair
-- A --fair queue ($1): its due jobs round-robin between limit keys (jobs without a key
-- are one more key, ''). The distinct keys of the queue's pending jobs come from a loose
-- index scan of jobs_pending_key_idx (one probe per key, due or not); each key gives its
-- first jobs by priority and run time, at most $2 / keys (at least 1) of them, ranked
-- 1, 2, ... within the key; the candidates are ordered by that rank, then priority and run
-- time, so key A's 100,000-job backlog gives one job per round like key B's 10. At most
-- $2 candidates, not locked here (a window over a recursive scan cannot be locked):
-- `lock_ids` locks them.
WITH RECURSIVE keys AS (
    (SELECT limit_key FROM duetime.jobs
      WHERE status = 'pending' AND limit_key IS NOT NULL AND queue = $1
      ORDER BY limit_key LIMIT 1)
    UNION ALL
    SELECT (SELECT j.limit_key FROM duetime.jobs AS j
             WHERE j.status = 'pending' AND j.limit_key IS NOT NULL AND j.queue = $1
               AND j.limit_key > k.limit_key
             ORDER BY j.limit_key LIMIT 1)
      FROM keys AS k
     WHERE k.limit_key IS NOT NULL
), each AS MATERIALIZED (
    SELECT limit_key FROM keys WHERE limit_key IS NOT NULL
), per AS (
    SELECT greatest(1, ceil($2::float8 / (count(*) + 1)))::int AS n FROM each
)
SELECT c.id, c.due_at, c.rank, c.priority, c.run
  FROM each AS k
 CROSS JOIN LATERAL (
    SELECT j.id, j.due_at, j.priority, coalesce(j.run_at, j.due_at) AS run,
           row_number() OVER (ORDER BY j.priority DESC, coalesce(j.run_at, j.due_at)) AS rank
      FROM duetime.jobs AS j
     WHERE j.status = 'pending' AND j.limit_key = k.limit_key AND j.queue = $1
       AND coalesce(j.run_at, j.due_at) <= now() AND j.due_at <= now()
     ORDER BY j.priority DESC, coalesce(j.run_at, j.due_at)
     LIMIT (SELECT n FROM per)) AS c
UNION ALL
SELECT c.id, c.due_at, c.rank, c.priority, c.run
  FROM (SELECT j.id, j.due_at, j.priority, coalesce(j.run_at, j.due_at) AS run,
               row_number() OVER (ORDER BY j.priority DESC, coalesce(j.run_at, j.due_at))
                   AS rank
          FROM duetime.jobs AS j
         WHERE j.status = 'pending' AND j.limit_key IS NULL AND j.queue = $1
           AND coalesce(j.run_at, j.due_at) <= now() AND j.due_at <= now()
         ORDER BY j.priority DESC, coalesce(j.run_at, j.due_at)
         LIMIT (SELECT n FROM per)) AS c
 ORDER BY rank, priority DESC, run
 LIMIT $2;

-- name: lock_ids
-- Lock the fair claim's candidates ($1 ids, $2..$3 their due_at range, as
-- mark_dispatched finds rows), still pending; the caller keeps the fair order.
SELECT id, task, queue, due_at, run_at, attempt, coalesce(limit_key, '') AS limit_key
  FROM duetime.jobs
 WHERE id = ANY($1::bigint[])
   AND due_at >= $2 AND due_at <= $3
   AND status = 'pending'
   FOR UPDATE SKIP LOCKED;

-- name: starts
-- Starts in the window now of the rate-limited targets ($1, with their periods in
-- seconds $2), per target and recorded key ('' unless the rate is per key), and the
-- seconds until the oldest of them leaves the window. Inside the dispatcher's fenced
-- transaction, before its claim: claim transactions of a shard never overlap, so this
-- sees every start committed before (migration 0018). statement_timestamp(), not now():
-- the window ends at this read, and `record_starts` stamps later than it.
-- Reads limit_starts_window_idx, one range per target.
SELECT s.target, s.limit_key, sum(s.starts)::bigint AS started,
       extract(epoch FROM min(s.started_at) + make_interval(secs => p.period)
                          - statement_timestamp())::float8 AS free_in
  FROM unnest($1::text[], $2::int[]) AS p(target, period)
  JOIN duetime.limit_starts AS s
    ON s.target = p.target
   AND s.started_at > statement_timestamp() - make_interval(secs => p.period)
 GROUP BY s.target, s.limit_key, p.period;

-- name: record_starts
-- The starts of one claim transaction: $1 targets, $2 keys ('' unless per key), $3
-- counts, stamped with this statement's time, after `mark_dispatched` (so at or after
-- the jobs' dispatched_at) and before the commit that makes both visible together.
INSERT INTO duetime.limit_starts (target, limit_key, started_at, starts)
SELECT target, limit_key, statement_timestamp(), starts
  FROM unnest($1::text[], $2::text[], $3::int[]) AS s(target, limit_key, starts);

-- name: busiest_keys
-- The keys of the per-key limits, at most $1 per limit, those with the most due jobs
-- first: per (target, key) its dispatched and due pending jobs and its starts in the
-- rate's window now. The dashboard's Limits page only; one grouped pass over the live
-- rows of the per-key targets, like `list`.
WITH live AS (
    SELECT l.target, coalesce(j.limit_key, '') AS limit_key,
           count(*) FILTER (WHERE j.status = 'dispatched') AS running,
           count(*) FILTER (WHERE j.status = 'pending'
                              AND coalesce(j.run_at, j.due_at) <= now()) AS due
      FROM duetime.limits AS l
      JOIN duetime.jobs AS j
        ON j.status IN ('pending', 'dispatched')
       AND (l.target = 'task:' || j.task OR l.target = 'queue:' || j.queue)
     WHERE l.per_key
     GROUP BY 1, 2
), ranked AS (
    SELECT v.*, row_number() OVER (PARTITION BY v.target
                                   ORDER BY v.due DESC, v.running DESC, v.limit_key) AS n
      FROM live AS v
)
SELECT r.target, r.limit_key, r.running, r.due,
       (SELECT coalesce(sum(s.starts), 0)::bigint
          FROM duetime.limit_starts AS s
         WHERE s.target = r.target AND s.limit_key = r.limit_key
           AND s.started_at > statement_timestamp() - make_interval(secs => l.rate_period))
           AS started
  FROM ranked AS r
  JOIN duetime.limits AS l ON l.target = r.target
 WHERE r.n <= $1
 ORDER BY r.target, r.n;
