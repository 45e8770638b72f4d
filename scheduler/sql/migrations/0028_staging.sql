-- duetime 0028: staging ahead (DESIGN §14; docs/architecture.md, "Staging ahead").
--
-- The dispatcher hands a job to a worker up to stage_ahead seconds before its run time
-- (dispatch.sql claim_staged / mark_staged): the row is `dispatched` with heartbeat_at
-- set to its run time, so "dispatched, heartbeat_at later than now" is a staged job no
-- worker has started yet. The worker holds the message and starts the job from its own
-- timer, through the same begin as any delivery: the row is authoritative at start. A
-- staged job must not start when, meanwhile, it was
--
-- - cancelled: the cancel makes the row `cancelled` (jobs.sql `cancel`, unchanged); the
--   begin finds it not dispatched and the worker acks the message without running it;
-- - paused: its queue (below: the pause gives the queue's staged jobs back to pending,
--   in the pausing transaction) or its schedule (cancel_planned_jobs, below: the jobs
--   planned ahead are cancelled whether staged or not);
-- - moved later (its run_at written by plain SQL): the begin returns the row's run
--   time, the worker compares it with the message's and gives the row back to pending
--   with worker_unstage (below), one call for the rare such job.
--
-- None of this costs a statement per job at start: the begin already reads the row.

-- Pausing a schedule (0006, 0011) cancels the jobs it planned that are not due yet; a
-- staged one is `dispatched` with its due_at still ahead (only staging dispatches a row
-- before its due time), so it is cancelled too.
CREATE OR REPLACE FUNCTION duetime.cancel_planned_jobs() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    ids bigint[];
    cancelled bigint;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NOT EXISTS (SELECT 1 FROM new_rows WHERE paused) THEN
            RETURN NULL;
        END IF;
        SELECT array_agg(n.id) INTO ids
          FROM new_rows n JOIN old_rows o ON o.id = n.id
         WHERE n.paused AND NOT o.paused;
    ELSE
        SELECT array_agg(id) INTO ids FROM old_rows;
    END IF;
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    WITH done AS (
        UPDATE duetime.jobs
           SET status = 'cancelled', finished_at = now(), heartbeat_at = NULL
         WHERE schedule_id = ANY (ids) AND status IN ('pending', 'dispatched')
           AND due_at > now()
        RETURNING id, schedule_id
    ), forgotten AS (
        DELETE FROM duetime.schedule_fires f
         USING done d
         WHERE f.schedule_id = d.schedule_id AND f.job_id = d.id
    )
    SELECT count(*) INTO cancelled FROM done;
    PERFORM set_config('duetime.planned_jobs_cancelled', cancelled::text, true);
    RETURN NULL;
END $$;

-- Pausing a queue (`duetime queues pause`: nothing new starts) gives its staged jobs
-- back to pending in the same transaction, so none starts from a worker's timer after
-- the pause committed; the dispatcher stages them again once the queue is resumed. The
-- predicate is jobs_dispatched_idx's expression (coalesce(heartbeat_at, dispatched_at)),
-- so the pause reads only the staged rows. The messages the workers hold then find
-- their row pending at begin and are acked without a run.
CREATE FUNCTION duetime.unstage_paused_queues() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    names text[];
BEGIN
    SELECT array_agg(n.name) INTO names
      FROM new_rows n JOIN old_rows o ON o.name = n.name
     WHERE n.paused AND NOT o.paused;
    IF names IS NULL THEN
        RETURN NULL;
    END IF;
    UPDATE duetime.jobs
       SET status = 'pending', dispatched_at = NULL, heartbeat_at = NULL,
           dispatch_epoch = NULL
     WHERE status = 'dispatched' AND queue = ANY (names)
       AND coalesce(heartbeat_at, dispatched_at) > now();
    RETURN NULL;
END $$;
REVOKE EXECUTE ON FUNCTION duetime.unstage_paused_queues() FROM PUBLIC;

CREATE TRIGGER queues_paused_unstage AFTER UPDATE ON duetime.queues
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION duetime.unstage_paused_queues();

-- A staged job whose row's run time is later than the one its message was staged for
-- (moved by plain SQL while staged): back to pending, this attempt and dispatch only,
-- so the dispatcher stages it again for its new run time. Returns the ids given back.
-- The worker calls it with the rows its begin found moved (rare: never in the hot path).
CREATE FUNCTION duetime.worker_unstage(job_ids bigint[], due_ats timestamptz[],
                                       attempts integer[], epochs bigint[])
    RETURNS SETOF bigint
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE duetime.jobs j
       SET status = 'pending', dispatched_at = NULL, heartbeat_at = NULL,
           dispatch_epoch = NULL
      FROM unnest(job_ids, due_ats, attempts, epochs) AS w(id, due_at, attempt, epoch)
     WHERE j.id = w.id AND j.due_at = w.due_at + interval '0'
       AND j.status = 'dispatched' AND j.attempt = w.attempt
       AND j.dispatch_epoch = w.epoch
       AND coalesce(j.run_at, j.due_at) > now()
    RETURNING j.id
$$;
REVOKE EXECUTE ON FUNCTION duetime.worker_unstage(bigint[], timestamptz[], integer[], bigint[])
    FROM PUBLIC;
