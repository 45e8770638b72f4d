-- The maintainer's statements (scheduler/duties/maintainer.py): daily buckets of
-- duetime.jobs created ahead and retired after the retention, old ledger / fire rows
-- pruned. Times come from the database clock; retention is given in seconds ($1).
-- Statements marked (fenced) run inside the maintainer's fenced transaction.

-- name: limits
-- (fenced) First statement after the fence check: how long this transaction may wait
-- for a lock, and how long any statement may run. A DDL statement that waits for
-- ACCESS EXCLUSIVE queues every later claim behind it, so it must give up quickly.
SELECT set_config('lock_timeout', $1::text, true),
       set_config('statement_timeout', $2::text, true);

-- name: missing_days
-- Days from today (UTC) to today + $1 that have no bucket yet, oldest first. Days in the
-- past are never (re)created: their rows live in DEFAULT, which every claim scans.
SELECT d::date AS day
  FROM generate_series((now() AT TIME ZONE 'UTC')::date,
                       (now() AT TIME ZONE 'UTC')::date + $1::integer,
                       interval '1 day') AS d
 WHERE to_regclass(format('duetime.%I', duetime.partition_name(d::date))) IS NULL
 ORDER BY 1;

-- name: expired_buckets
-- Buckets of duetime.jobs whose whole range ended more than $1 seconds ago, oldest
-- first, and whether each still holds a pending or dispatched row (index probes only;
-- the detach checks again under its lock).
SELECT duetime.partition_day(c.relname) AS day,
       duetime.partition_is_live(c.oid::regclass) AS live
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'duetime.jobs'::regclass
   AND duetime.partition_day(c.relname) IS NOT NULL
   AND ((duetime.partition_day(c.relname) + 1)::timestamp AT TIME ZONE 'UTC')
       <= now() - make_interval(secs => $1::float8)
 ORDER BY 1;

-- name: detached_leftovers
-- Buckets detached by an earlier pass that did not get to drop them (crash, lock timeout).
SELECT c.relname AS name
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'duetime' AND c.relkind = 'r' AND NOT c.relispartition
   AND c.relname ~ '^jobs_p[0-9]{8}_detached$'
 ORDER BY 1;

-- name: create_bucket
-- (fenced) Creates the bucket of day $1 (moving that day's rows out of DEFAULT, then
-- ATTACH); false if it exists. ATTACH holds ACCESS EXCLUSIVE on DEFAULT while it scans
-- it, which is why DEFAULT must stay small (buckets ahead; prune_default). Refused for a
-- day before today or more than 100 days ahead (migration 0010).
SELECT duetime.create_bucket($1::date);

-- name: detach_bucket
-- (fenced) 'detached' | 'live' | 'missing' (migration 0003); refused for a day whose
-- range has not ended (migration 0010).
SELECT duetime.detach_terminal_partition($1::date);

-- name: drop_detached
-- (fenced)
SELECT duetime.drop_detached_partition($1::text);

-- name: prune_ledger
-- (fenced) One batch of at most $2 ledger rows completed more than $1 seconds ago,
-- oldest first, never the row of a job still pending or dispatched; a retention under
-- one day is refused (duetime.prune_ledger, migration 0013). Returns how many went.
SELECT duetime.prune_ledger($1::float8, $2::int);

-- name: prune_fires
-- (fenced) One batch of schedule_fires rows older than $1 seconds. A fire row is only
-- dropped once the schedule's next_fire_at is past it, so deduplication never loses a
-- row it may still need. Bounded: walks each schedule's primary-key range, at most $2 rows in all.
WITH doomed AS (
    SELECT s.id AS schedule_id, f.fire_time
      FROM duetime.schedules s
     CROSS JOIN LATERAL (
           SELECT fire_time
             FROM duetime.schedule_fires
            WHERE schedule_id = s.id
              AND fire_time < least(now() - make_interval(secs => $1::float8),
                                    coalesce(s.next_fire_at, 'infinity'::timestamptz))
            ORDER BY fire_time
            LIMIT $2) f
     LIMIT $2
), gone AS (
    DELETE FROM duetime.schedule_fires f
     USING doomed d
     WHERE f.schedule_id = d.schedule_id AND f.fire_time = d.fire_time
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_default
-- (fenced) One batch of terminal rows in DEFAULT that were due and finished more than
-- $1 seconds ago, at most $2 (duetime.prune_default, migration 0010): rows inserted into
-- the range of a bucket already dropped (or before the first one) land there, and would
-- otherwise stay forever. Pending and dispatched rows are never touched: they are
-- claimed from DEFAULT. Returns how many went.
SELECT duetime.prune_default($1::float8, $2::int);

-- name: prune_limit_starts
-- (fenced) One batch of at most $1 rows of the rate limits' start log (migration 0018)
-- that left their target's window: older than its rate_period, or of a target without a
-- rate now. The window sums read only the last period, so this only keeps the table small.
WITH doomed AS (
    SELECT s.ctid AS row_id
      FROM duetime.limit_starts AS s
      LEFT JOIN duetime.limits AS l ON l.target = s.target AND l.rate_period IS NOT NULL
     WHERE s.started_at < now() - make_interval(secs => coalesce(l.rate_period, 0))
     LIMIT $1
), gone AS (
    DELETE FROM duetime.limit_starts AS s
     USING doomed AS d
     WHERE s.ctid = d.row_id
    RETURNING 1
)
SELECT count(*) FROM gone;
