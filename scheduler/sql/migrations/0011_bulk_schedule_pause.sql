-- duetime 0011: pausing or deleting schedules in bulk costs one statement's work, not
-- one per row (docs/security.md "Bulk schedule pause", docs/benchmarks.md).
--
-- 0006 ran duetime.cancel_planned_jobs() FOR EACH ROW that became paused (or was
-- deleted): per row, one UPDATE of the partitioned duetime.jobs (planned, locked and
-- executed again for every bucket, the plan being generic) and one DELETE on
-- schedule_fires. 10,000 every-second schedules paused by one
-- `UPDATE duetime.schedules SET paused = true` took minutes. Now the same function runs
-- once per statement, on its transition tables: one UPDATE of the jobs of every
-- schedule the statement paused (or deleted) and one DELETE of their fire times.
-- Behaviour is unchanged: the jobs planned ahead that are not due yet are cancelled
-- and their fire times forgotten, the count goes to the transaction-local setting
-- duetime.planned_jobs_cancelled (the total of the statement), and a statement that
-- pauses nothing (already paused rows, the planner's own batches) leaves it alone.
-- Resuming never cost more than the before-update trigger's few comparisons (the
-- planner plans resumed rows again); it is unchanged.
--
-- PostgreSQL forbids a column list (UPDATE OF paused) on a trigger with transition
-- tables, so the update trigger fires for every UPDATE statement on schedules; what
-- a statement without a newly paused row pays is one scan of its NEW TABLE for a
-- paused row (the planner's batches: up to batch_size rows, none paused as a rule).
-- Deleting: AFTER, since the rows' fire times are gone by then (ON DELETE CASCADE);
-- only the jobs are left to cancel.

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
           SET status = 'cancelled', finished_at = now()
         WHERE schedule_id = ANY (ids) AND status = 'pending' AND due_at > now()
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
REVOKE EXECUTE ON FUNCTION duetime.cancel_planned_jobs() FROM PUBLIC;

DROP TRIGGER schedules_paused_cancel_planned ON duetime.schedules;
CREATE TRIGGER schedules_paused_cancel_planned AFTER UPDATE ON duetime.schedules
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION duetime.cancel_planned_jobs();

DROP TRIGGER schedules_delete_cancel_planned ON duetime.schedules;
CREATE TRIGGER schedules_delete_cancel_planned AFTER DELETE ON duetime.schedules
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION duetime.cancel_planned_jobs();
