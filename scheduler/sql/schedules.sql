-- Recurring schedules (DESIGN §3, §5b): the client API (add, read, pause, resume, remove,
-- trigger) and the planner's statements (claim, apply a batch of decisions, wake-up probe).
-- `plan_at` may hold 'infinity', which asyncpg cannot return as an aware datetime: every
-- read returns `plan_at = 'infinity' AS finished` next to the row and the code ignores
-- the raw column.

-- name: insert
INSERT INTO duetime.schedules (name, task, payload, queue, max_attempts, cron, interval,
                               timezone, start_at, end_at, paused, misfire_policy,
                               misfire_cap, overlap_policy, jitter)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
RETURNING *, plan_at = 'infinity' AS finished;

-- name: resolve
-- A schedule by name, or by id when the reference is a number; a name wins.
SELECT *, plan_at = 'infinity' AS finished
  FROM duetime.schedules
 WHERE name = $1 OR id = $2
 ORDER BY name = $1 DESC
 LIMIT 1;

-- name: list
-- Keyset pagination on id.
SELECT *, plan_at = 'infinity' AS finished
  FROM duetime.schedules
 WHERE ($1::boolean IS NULL OR paused = $1)
   AND ($2::bigint IS NULL OR id > $2)
 ORDER BY id
 LIMIT $3;

-- name: lock
-- Taken first by pause and remove: waits for a planner batch holding the row, so the
-- jobs that batch created are visible to the next statement (a new snapshot).
SELECT id FROM duetime.schedules WHERE id = $1 FOR UPDATE;

-- name: pause
-- The trigger schedules_paused_cancel_planned (migrations 0006, 0011: once per statement)
-- cancels the jobs planned ahead that are not due yet, as it does for
-- `UPDATE ... SET paused = true` by plain SQL, however many rows that pauses.
UPDATE duetime.schedules SET paused = true WHERE id = $1
RETURNING *, plan_at = 'infinity' AS finished;

-- name: planned_cancelled
-- How many jobs the pause or delete trigger of this transaction cancelled (0: none ran).
SELECT coalesce(nullif(current_setting('duetime.planned_jobs_cancelled', true), ''), '0')::bigint;

-- name: resume
-- The before-update trigger resets next_fire_at: a resumed schedule starts from now
-- (fire times inside the pause are not caught up: pausing is deliberate).
UPDATE duetime.schedules SET paused = false, last_error = NULL WHERE id = $1
RETURNING *, plan_at = 'infinity' AS finished;

-- name: delete
-- The trigger schedules_delete_cancel_planned cancels the jobs planned ahead, as pause.
DELETE FROM duetime.schedules WHERE id = $1
RETURNING *, false AS finished;

-- name: trigger
-- Fire now, once, outside the timing: a job with the schedule's task and payload, due now.
INSERT INTO duetime.jobs (task, payload, queue, max_attempts, due_at, idempotency_key,
                          schedule_id)
SELECT task, payload, queue, max_attempts, now(),
       'schedule:' || id || ':trigger:'
           || to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
       id
  FROM duetime.schedules
 WHERE id = $1
RETURNING *;

-- name: notify_jobs
-- Wake the dispatcher for jobs due within a second (NOTIFY_HORIZON, as the jobs API
-- does): sent in the planner's transaction only when a batch created such jobs
-- (catch-ups, just-in-time overlap schedules), and after a manual trigger.
SELECT pg_notify('duetime_jobs', '');

-- name: recent_runs
-- The latest jobs of a schedule (jobs_schedule_idx, newest due_at first).
SELECT * FROM duetime.jobs
 WHERE schedule_id = $1
 ORDER BY due_at DESC, id DESC
 LIMIT $2;

-- name: claimed_columns
-- What the planner reads of a schedule it claimed (claim_due, claimed_schedule).
-- previous_active: the last job materialized for the schedule is not terminal (read only
-- for the overlap policies that need it; a job already deleted by retention counts as
-- finished).
s.*, s.plan_at = 'infinity' AS finished,
CASE WHEN s.overlap_policy <> 'allow' AND s.last_job_id IS NOT NULL THEN
    EXISTS (SELECT 1 FROM duetime.jobs j
             WHERE j.id = s.last_job_id AND j.due_at = s.last_job_due_at
               AND j.status IN ('pending', 'dispatched'))
ELSE false END AS previous_active

-- name: claim_due
-- Planner, inside its fenced transaction: schedules to look at by $1 (the planner's now),
-- oldest plan_at first. The columns placeholder is `claimed_columns` (ScheduleStore), or
-- only `s.id` when a row of it cannot be read by the client: the same rows, locked the
-- same way, each then read alone (claimed_schedule).
SELECT {columns}
  FROM duetime.schedules s
 WHERE NOT s.paused
   AND coalesce(s.plan_at, '-infinity'::timestamptz) <= $1
 ORDER BY coalesce(s.plan_at, '-infinity'::timestamptz)
 LIMIT $2
   FOR UPDATE OF s SKIP LOCKED;

-- name: claimed_schedule
-- One schedule the id-only claim_due locked, as claim_due returns it.
SELECT {columns}
  FROM duetime.schedules s
 WHERE s.id = $1 AND NOT s.paused;

-- name: pause_unreadable
-- A schedule the planner cannot read is paused with the reason (by id alone).
UPDATE duetime.schedules SET paused = true, last_error = $2 WHERE id = $1 AND NOT paused;

-- name: apply_plan
-- Planner, same transaction: a batch of decisions in ONE statement (arrays, not a round
-- trip per schedule). Fire times ($1..$4: schedule, fire time, due_at, idempotency key)
-- go into schedule_fires first; only the ones that were not there already become jobs
-- (ids taken from the jobs sequence up front, so the job is created with the fire row).
-- Then every claimed schedule ($5..$11) gets its new state; counters add up; a decision
-- with an error pauses the schedule and keeps its planning state. Returns, per
-- schedule, how many jobs were created.
WITH wanted AS (
    SELECT *
      FROM unnest($1::bigint[], $2::timestamptz[], $3::timestamptz[], $4::text[])
        AS w(schedule_id, fire_time, due_at, idempotency_key)
), fired AS (
    INSERT INTO duetime.schedule_fires AS f (schedule_id, fire_time, job_id, due_at)
    SELECT schedule_id, fire_time, nextval('duetime.jobs_id_seq'), due_at FROM wanted
    ON CONFLICT (schedule_id, fire_time) DO NOTHING
    RETURNING f.schedule_id, f.fire_time, f.job_id, f.due_at
), created AS (
    INSERT INTO duetime.jobs (id, task, payload, queue, max_attempts, due_at,
                              idempotency_key, schedule_id)
    SELECT d.job_id, s.task, s.payload, s.queue, s.max_attempts, d.due_at,
           w.idempotency_key, d.schedule_id
      FROM fired d
      JOIN wanted w ON w.schedule_id = d.schedule_id AND w.fire_time = d.fire_time
      JOIN duetime.schedules s ON s.id = d.schedule_id
    RETURNING schedule_id
), latest AS (
    SELECT DISTINCT ON (schedule_id)
           schedule_id, fire_time, job_id, due_at,
           count(*) OVER (PARTITION BY schedule_id) AS n
      FROM fired
     ORDER BY schedule_id, fire_time DESC
)
UPDATE duetime.schedules AS s
   SET next_fire_at = u.next_fire_at,
       plan_at = CASE WHEN u.error IS NOT NULL THEN s.plan_at
                      ELSE coalesce(u.plan_at, 'infinity') END,
       buffered_fire_at = u.buffered_fire_at,
       paused = s.paused OR u.error IS NOT NULL,
       last_error = u.error,
       fired_count = s.fired_count + coalesce(l.n, 0),
       skipped_count = s.skipped_count + u.skipped,
       missed_count = s.missed_count + u.missed,
       last_fired_at = CASE WHEN l.fire_time IS NULL THEN s.last_fired_at
                            ELSE greatest(s.last_fired_at, l.fire_time) END,
       last_job_id = coalesce(l.job_id, s.last_job_id),
       last_job_due_at = coalesce(l.due_at, s.last_job_due_at)
  FROM unnest($5::bigint[], $6::timestamptz[], $7::timestamptz[], $8::timestamptz[],
              $9::bigint[], $10::bigint[], $11::text[])
         AS u(id, next_fire_at, plan_at, buffered_fire_at, skipped, missed, error)
  LEFT JOIN latest l ON l.schedule_id = u.id
 WHERE s.id = u.id
RETURNING s.id, coalesce(l.n, 0)::integer AS fired;

-- name: next_plan_at
-- The planner's wake-up probe: the earliest plan_at of an active schedule, as epoch
-- seconds (-Infinity: one waits to be planned now; Infinity or NULL: nothing to do).
-- A Limit over schedules_plan_idx.
SELECT extract(epoch FROM min(coalesce(plan_at, '-infinity'::timestamptz)))::float8
  FROM duetime.schedules
 WHERE NOT paused;

-- Schedules as code (ScheduleStore.apply, scheduler/planning/declared.py) ---------------

-- name: apply_lock
-- Serialises applies, so every deploy may run one at once: the second sees what the
-- first wrote and has nothing left to do. One constant key of the bigint form, apart
-- from the attempt guard's two-int4 keys (0012).
SELECT pg_advisory_xact_lock(hashtextextended('duetime:schedules:apply', 0));

-- name: declared_or_managed
-- The schedules an apply compares with: those named by the declaration and those its
-- source owns.
SELECT *, plan_at = 'infinity' AS finished
  FROM duetime.schedules
 WHERE name = ANY ($1::text[]) OR managed_by = $2
 ORDER BY id;

-- name: insert_managed
INSERT INTO duetime.schedules (name, task, payload, queue, max_attempts, cron, interval,
                               timezone, start_at, end_at, paused, misfire_policy,
                               misfire_cap, overlap_policy, jitter, managed_by)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)
RETURNING *, plan_at = 'infinity' AS finished;

-- name: reset_cancelled
-- Between two changes of one apply: the next planned_cancelled counts only its own.
SELECT set_config('duetime.planned_jobs_cancelled', '0', true);

-- name: redefine
-- A declaration's new definition, after `pause` cancelled the jobs planned ahead under
-- the old one: planned again from now (next_fire_at and plan_at NULL), the old error
-- cleared. The before-update trigger keeps updated_at.
UPDATE duetime.schedules
   SET task = $2, payload = $3, queue = $4, max_attempts = $5, cron = $6, interval = $7,
       timezone = $8, start_at = $9, end_at = $10, paused = $11, misfire_policy = $12,
       misfire_cap = $13, overlap_policy = $14, jitter = $15, managed_by = $16,
       last_error = NULL, next_fire_at = NULL, plan_at = NULL
 WHERE id = $1
RETURNING *, plan_at = 'infinity' AS finished;
