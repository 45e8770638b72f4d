-- Declared queues (migration 0008; scheduler/store/queues.py, `duetime queues`).
-- Only jobs of a queue in duetime.queues are claimed and published (dispatch.sql claim);
-- the broker queue duetime.<name> is created by the leader's first publish to it.

-- name: add
-- The CHECK queues_name_invalid refuses a bad name (the CLI validates first).
INSERT INTO duetime.queues (name)
VALUES ($1)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: add_many
-- The queues of the `queues` setting, declared by `duetime migrate`; returns those new.
INSERT INTO duetime.queues (name)
SELECT unnest($1::text[])
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: remove
DELETE FROM duetime.queues WHERE name = $1 RETURNING name;

-- name: set_paused
-- `duetime queues pause|resume`: a paused queue's jobs are not claimed (dispatch.sql);
-- the ones already dispatched run to their end. NULL when the queue is not declared.
UPDATE duetime.queues SET paused = $2 WHERE name = $1 RETURNING name;

-- name: wake
-- Wake the dispatcher (it LISTENs on duetime_jobs): jobs held for a queue just declared
-- go out at once rather than at the next probe.
SELECT pg_notify('duetime_jobs', '');

-- name: live_jobs
-- Pending and dispatched jobs of one queue ($1).
SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'dispatched') AS dispatched
  FROM duetime.jobs
 WHERE status IN ('pending', 'dispatched') AND queue = $1;

-- name: list
-- Every declared queue and every queue name live jobs carry (declared or not), with
-- their pending and dispatched jobs; `held` is the pending jobs of an undeclared queue
-- (the dispatcher leaves them pending). Declared queues first, at most $1 rows.
WITH live AS (
    SELECT queue,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'dispatched') AS dispatched
      FROM duetime.jobs
     WHERE status IN ('pending', 'dispatched')
     GROUP BY queue
)
SELECT coalesce(q.name, l.queue) AS name,
       q.name IS NOT NULL AS declared,
       q.created_at,
       coalesce(q.paused, false) AS paused,
       coalesce(l.pending, 0) AS pending,
       coalesce(l.dispatched, 0) AS dispatched,
       CASE WHEN q.name IS NULL THEN coalesce(l.pending, 0) ELSE 0 END AS held
  FROM duetime.queues AS q
  FULL JOIN live AS l ON l.queue = q.name
 ORDER BY declared DESC, name
 LIMIT $1;

-- name: is_declared
SELECT EXISTS (SELECT 1 FROM duetime.queues WHERE name = $1);
