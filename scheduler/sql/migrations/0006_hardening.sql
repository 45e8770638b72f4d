-- duetime 0006: no single row can stop dispatch or planning, a paused schedule is paused
-- however it was paused, the fence is the database's, and re-publishing is bounded
-- (docs/security.md "Hardening" lists each part with the test that proves it).

-- 1. Dates every client can read. PostgreSQL stores timestamps from 4713 BC to 294276 AD;
-- Python's datetime (asyncpg returns one per column) holds years 1 to 9999 only, so one
-- row outside that range makes every statement that reads it fail in the client
-- (OverflowError), and a BC due_at sorts first in every claim. The bounds keep one day
-- of margin at each end so that showing a bound in any time zone (UTC-12 .. UTC+14)
-- stays inside Python's range too: 0001-01-02 <= t < 9999-12-31, UTC.
--
-- Rows already out of range are parked first, so the migration never fails on them and
-- afterwards every row satisfies the constraints: a job goes dead, a schedule is paused,
-- each with last_error naming the value, and the value itself is moved to the nearest
-- bound (a job's due_at; it runs nowhere, since the job is dead) or cleared (a
-- schedule's date; the schedule stays paused until someone reads the error and fixes
-- it). Only the DEFAULT bucket can hold such a job (daily buckets cover the present),
-- and the partition key prunes the UPDATE to it.
UPDATE duetime.jobs
   SET status = CASE WHEN status IN ('pending', 'dispatched') THEN 'dead' ELSE status END,
       finished_at = coalesce(finished_at, now()),
       last_error = format('due_at %s is outside the supported range (0001-01-02 to '
                           '9999-12-30 UTC); parked as dead, due_at moved to the bound',
                           due_at AT TIME ZONE 'UTC'),
       due_at = CASE WHEN due_at < '0001-01-02 00:00:00+00' THEN '0001-01-02 00:00:00+00'
                     ELSE '9999-12-30 23:59:59+00' END::timestamptz,
       run_at = NULL
 WHERE due_at < '0001-01-02 00:00:00+00' OR due_at >= '9999-12-31 00:00:00+00';

UPDATE duetime.jobs
   SET status = CASE WHEN status IN ('pending', 'dispatched') THEN 'dead' ELSE status END,
       finished_at = coalesce(finished_at, now()),
       last_error = format('run_at %s is outside the supported range (before 9999-12-31 '
                           'UTC); parked as dead', run_at AT TIME ZONE 'UTC'),
       run_at = NULL
 WHERE run_at >= '9999-12-31 00:00:00+00';

CREATE FUNCTION duetime.readable_time(t timestamptz) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN t >= '0001-01-02 00:00:00+00'::timestamptz AND t < '9999-12-31 00:00:00+00'::timestamptz;

UPDATE duetime.schedules
   SET paused = true,
       last_error = concat_ws('; ',
           CASE WHEN NOT duetime.readable_time(start_at)
                THEN format('start_at %s', start_at AT TIME ZONE 'UTC') END,
           CASE WHEN NOT duetime.readable_time(end_at)
                THEN format('end_at %s', end_at AT TIME ZONE 'UTC') END,
           CASE WHEN NOT duetime.readable_time(next_fire_at)
                THEN format('next_fire_at %s', next_fire_at AT TIME ZONE 'UTC') END,
           CASE WHEN interval > interval '3652058 days'
                THEN format('interval %s', interval) END)
           || ' outside the supported range (dates 0001-01-02 to 9999-12-30 UTC, interval '
           || 'at most 3652058 days); paused, a date cleared, an interval set to 1 day: '
           || 'set the right value and resume',
       start_at = CASE WHEN duetime.readable_time(start_at) THEN start_at END,
       end_at = CASE WHEN duetime.readable_time(end_at) THEN end_at END,
       next_fire_at = CASE WHEN duetime.readable_time(next_fire_at) THEN next_fire_at END,
       interval = CASE WHEN interval > interval '3652058 days' THEN interval '1 day'
                       ELSE interval END
 WHERE NOT duetime.readable_time(start_at) OR NOT duetime.readable_time(end_at)
    OR NOT duetime.readable_time(next_fire_at) OR interval > interval '3652058 days';

-- Planner state the planner writes itself: ±infinity is allowed where it means
-- something (plan_at 'infinity': nothing left to plan), a finite value must be readable.
UPDATE duetime.schedules
   SET paused = true, plan_at = NULL, buffered_fire_at = NULL,
       last_fired_at = CASE WHEN duetime.readable_time(last_fired_at) THEN last_fired_at END,
       last_job_due_at = CASE WHEN duetime.readable_time(last_job_due_at)
                              THEN last_job_due_at END,
       last_error = 'planner state outside the supported range of dates; paused, the state '
                    'cleared: resume to plan again from now'
 WHERE (isfinite(plan_at) AND NOT duetime.readable_time(plan_at))
    OR NOT duetime.readable_time(buffered_fire_at)
    OR NOT duetime.readable_time(last_fired_at)
    OR NOT duetime.readable_time(last_job_due_at);

-- NOT VALID, as in 0005: validating scans every bucket under the ACCESS EXCLUSIVE lock
-- ADD CONSTRAINT takes, and the UPDATEs above already made every row comply, so there is
-- nothing to find (`ALTER TABLE ... VALIDATE CONSTRAINT` later takes a weaker lock, for
-- whoever wants it marked validated). New and updated rows are checked. On a partitioned
-- table PostgreSQL 15 adds a CHECK to every bucket, and ensure_partition copies it into
-- new buckets (LIKE ... INCLUDING CONSTRAINTS) before ATTACH, which requires it.
-- Names sort after jobs_due_at_not_finite, which PostgreSQL checks first, so ±infinity
-- keeps reporting that name.
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_due_at_out_of_range
    CHECK (due_at >= '0001-01-02 00:00:00+00' AND due_at < '9999-12-31 00:00:00+00') NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_run_at_out_of_range
    CHECK (run_at IS NULL OR run_at < '9999-12-31 00:00:00+00') NOT VALID;
ALTER TABLE duetime.schedules ADD CONSTRAINT schedules_start_at_out_of_range
    CHECK (start_at IS NULL OR (start_at >= '0001-01-02 00:00:00+00'
                                AND start_at < '9999-12-31 00:00:00+00')) NOT VALID;
ALTER TABLE duetime.schedules ADD CONSTRAINT schedules_end_at_out_of_range
    CHECK (end_at IS NULL OR (end_at >= '0001-01-02 00:00:00+00'
                              AND end_at < '9999-12-31 00:00:00+00')) NOT VALID;
ALTER TABLE duetime.schedules ADD CONSTRAINT schedules_next_fire_at_out_of_range
    CHECK (next_fire_at IS NULL OR (next_fire_at >= '0001-01-02 00:00:00+00'
                                    AND next_fire_at < '9999-12-31 00:00:00+00')) NOT VALID;
-- No period can be longer than the range of dates itself; a longer one does not fit
-- Python's timedelta either (999,999,999 days, where PostgreSQL allows 2^31).
ALTER TABLE duetime.schedules ADD CONSTRAINT schedules_interval_too_long
    CHECK (interval IS NULL OR interval <= interval '3652058 days') NOT VALID;
ALTER TABLE duetime.schedules ADD CONSTRAINT schedules_planner_state_out_of_range
    CHECK ((plan_at IS NULL OR NOT isfinite(plan_at) OR duetime.readable_time(plan_at))
           AND (buffered_fire_at IS NULL OR duetime.readable_time(buffered_fire_at))
           AND (last_fired_at IS NULL OR duetime.readable_time(last_fired_at))
           AND (last_job_due_at IS NULL OR duetime.readable_time(last_job_due_at))) NOT VALID;

-- 2. Pausing is the table's, not the CLI's. A schedule that becomes paused (by
-- `duetime schedules pause`, by plain SQL, or by the planner pausing a bad row) and a
-- schedule that is deleted lose the jobs planned ahead for it that are not due yet:
-- they are cancelled and their fire times forgotten, so a resume plans them again.
-- This function is the only copy of that transition; the CLI reads how many jobs it
-- cancelled from the transaction-local setting duetime.planned_jobs_cancelled.
-- SECURITY DEFINER: whoever may pause a schedule may cancel its planned jobs, without a
-- grant on duetime.jobs of their own (roles.sql); it touches nothing else.
CREATE FUNCTION duetime.cancel_planned_jobs() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cancelled bigint;
BEGIN
    WITH done AS (
        UPDATE duetime.jobs
           SET status = 'cancelled', finished_at = now()
         WHERE schedule_id = OLD.id AND status = 'pending' AND due_at > now()
        RETURNING id
    ), forgotten AS (
        DELETE FROM duetime.schedule_fires f
         USING done d
         WHERE f.schedule_id = OLD.id AND f.job_id = d.id
    )
    SELECT count(*) INTO cancelled FROM done;
    PERFORM set_config('duetime.planned_jobs_cancelled', cancelled::text, true);
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NULL END;
END $$;
REVOKE EXECUTE ON FUNCTION duetime.cancel_planned_jobs() FROM PUBLIC;

CREATE TRIGGER schedules_paused_cancel_planned AFTER UPDATE OF paused ON duetime.schedules
    FOR EACH ROW WHEN (NEW.paused AND NOT OLD.paused)
    EXECUTE FUNCTION duetime.cancel_planned_jobs();
-- BEFORE: the fire rows still exist (ON DELETE CASCADE removes them after).
CREATE TRIGGER schedules_delete_cancel_planned BEFORE DELETE ON duetime.schedules
    FOR EACH ROW EXECUTE FUNCTION duetime.cancel_planned_jobs();

-- 3. The fence, enforced by the database. A job row that becomes dispatched, or gets a
-- new dispatch (epoch or dispatched_at changes: a reconciler re-publish), must carry the
-- epoch leader_fence holds when its transaction commits; otherwise the COMMIT fails with
-- constraint jobs_dispatch_fenced. Deferred to commit, and the fence row is locked
-- FOR SHARE, so a newer leader's advance waits for this commit or makes it fail: a claim
-- committed under a fenced-out epoch is impossible whatever the client code does
-- (fence.py's check only makes a zombie give up earlier). Row-level because PostgreSQL
-- has no deferred statement triggers; the WHEN clause keeps every other update of a job
-- (heartbeats, completions, retries) free of it. Measured in docs/security.md.
CREATE FUNCTION duetime.check_dispatch_fence() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    current bigint;
BEGIN
    SELECT epoch INTO current FROM duetime.leader_fence WHERE shard = 0 FOR SHARE;
    IF NEW.dispatch_epoch IS DISTINCT FROM current THEN
        RAISE EXCEPTION 'job % dispatched under epoch %, but the fence holds epoch %',
                NEW.id, coalesce(NEW.dispatch_epoch::text, 'NULL'), current
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'jobs_dispatch_fenced',
                  HINT = 'only the leader of the newest epoch may dispatch jobs';
    END IF;
    RETURN NULL;
END $$;
REVOKE EXECUTE ON FUNCTION duetime.check_dispatch_fence() FROM PUBLIC;

CREATE CONSTRAINT TRIGGER jobs_dispatch_fenced AFTER UPDATE ON duetime.jobs
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.status = 'dispatched'
          AND (OLD.status <> 'dispatched'
               OR NEW.dispatch_epoch IS DISTINCT FROM OLD.dispatch_epoch
               OR NEW.dispatched_at IS DISTINCT FROM OLD.dispatched_at))
    EXECUTE FUNCTION duetime.check_dispatch_fence();
CREATE CONSTRAINT TRIGGER jobs_dispatch_fenced_insert AFTER INSERT ON duetime.jobs
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.status = 'dispatched')
    EXECUTE FUNCTION duetime.check_dispatch_fence();

-- 4. Re-publishes since the job was last dispatched, kept in the row so the cap
-- (setting max_republishes, scheduler/duties/reconciler.py) holds across leaders.
-- A constant default on a new column is a catalog-only change, in every bucket.
ALTER TABLE duetime.jobs ADD COLUMN republish_count integer NOT NULL DEFAULT 0;
