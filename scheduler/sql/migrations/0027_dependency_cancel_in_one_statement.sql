-- duetime 0027: a failed dependency cancels its transitive dependents in one statement
-- (docs/architecture.md, "Workflows").
--
-- In 0025 a dependency that ended dead or cancelled cancelled its direct dependents, and
-- each of those rows' own trigger cancelled the next level: one nested trigger call per
-- level of the workflow. A chain of about 500 steps or more whose first step died
-- exceeded PostgreSQL's max_stack_depth, so the dead outcome itself could not commit and
-- its job was delivered again and again (measured: a 400-step chain cancelled in 2.0 s,
-- a 700-step chain failed with "stack depth limit exceeded"). Now the trigger of the
-- failed job finds every waiting job that cancels on failure downstream of it with one
-- recursive query over duetime.job_dependencies and cancels them all in one UPDATE; the
-- cancelled rows' own triggers run one level down and find nothing left to cancel (they
-- still release the dependents that run on failure). The reason a job gets is unchanged
-- for a direct dependent ("dependency 12 (resize) dead: ..."); one further down names
-- the job it depends on and the root cause ("dependency 13 (thumb) cancelled:
-- dependency 12 (resize) dead: ..."), no longer the whole chain in between.
--
-- Every function of the workflow triggers runs its statements on generic plans. Their
-- lookups by job id cannot be pruned by due time, and PL/pgSQL kept choosing custom
-- plans, re-planning each statement over every bucket on every call: inserting a job
-- with depends_on cost 21 ms in jobs_check_dependencies, 0.7 ms with generic plans
-- (measured with 17 buckets; a 1,000-step chain inserted in 17 s, now in 1.2 s, and its
-- first step's death cancels the 999 others in 1.3 s).
--
-- CREATE OR REPLACE keeps the function's owner; the triggers of 0025 call it unchanged.

-- AFTER UPDATE into an outcome, for a row somebody waits for or a waiting row.
CREATE OR REPLACE FUNCTION duetime.jobs_release_dependents() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    ids bigint[];
    dues timestamptz[];
    reason text;
    doomed_ids bigint[];
    doomed_dues timestamptz[];
    doomed_reasons text[];
    k integer;
BEGIN
    IF OLD.status = 'waiting' THEN  -- a waiting job ended (cancelled): drop its edges
        DELETE FROM duetime.job_dependencies WHERE dependent_id = NEW.id;
    END IF;
    IF NOT NEW.has_dependents THEN
        RETURN NULL;
    END IF;
    WITH gone AS (
        DELETE FROM duetime.job_dependencies WHERE dependency_id = NEW.id
        RETURNING dependent_id, dependent_due_at
    )
    SELECT array_agg(dependent_id ORDER BY dependent_id),
           array_agg(dependent_due_at ORDER BY dependent_id)
      INTO ids, dues FROM gone;
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    IF NEW.status <> 'succeeded' THEN
        reason := left(format('dependency %s (%s) %s', NEW.id, NEW.task, NEW.status)
                       || coalesce(': ' || NEW.last_error, ''), 2000);
        -- Every waiting job that cancels on failure and depends on this one, directly or
        -- through other such jobs, with the job it depends on that ends it (its parent;
        -- the lowest id where it has two): one row per (job, parent) edge, so a DAG's
        -- diamonds cost their edges, not their paths.
        WITH RECURSIVE doomed(id, due_at, task, parent_id, parent_task) AS (
            SELECT r.id, r.due_at, r.task, NEW.id, NEW.task
              FROM duetime.jobs r
              JOIN unnest(ids, dues) AS d(id, due_at)
                ON r.id = d.id AND r.due_at = d.due_at
             WHERE r.status = 'waiting' AND r.on_dependency_failure = 'cancel'
            UNION
            SELECT r.id, r.due_at, r.task, x.id, x.task
              FROM doomed x
              JOIN duetime.job_dependencies e ON e.dependency_id = x.id
              JOIN duetime.jobs r ON r.id = e.dependent_id AND r.due_at = e.dependent_due_at
             WHERE r.status = 'waiting' AND r.on_dependency_failure = 'cancel'
        ), nearest AS (
            SELECT DISTINCT ON (id) id, due_at, parent_id, parent_task
              FROM doomed ORDER BY id, parent_id = NEW.id DESC, parent_id
        )
        SELECT array_agg(id ORDER BY id), array_agg(due_at ORDER BY id),
               array_agg(CASE WHEN parent_id = NEW.id THEN reason
                              ELSE left(format('dependency %s (%s) cancelled: ', parent_id,
                                               parent_task) || reason, 2000) END
                         ORDER BY id)
          INTO doomed_ids, doomed_dues, doomed_reasons FROM nearest;
        -- Locked in id order (as every cancel does), each re-checked after its lock: a
        -- row another transaction ended meanwhile is left as that one left it.
        UPDATE duetime.jobs j
           SET status = 'cancelled', finished_at = now(), cancelled_by = 'dependency',
               last_error = c.reason
          FROM (SELECT r.id, r.due_at, d.reason FROM duetime.jobs r
                  JOIN unnest(doomed_ids, doomed_dues, doomed_reasons)
                           AS d(id, due_at, reason)
                    ON r.id = d.id AND r.due_at = d.due_at
                 WHERE r.status = 'waiting' AND r.on_dependency_failure = 'cancel'
                 ORDER BY r.id
                   FOR UPDATE OF r) c
         WHERE j.id = c.id AND j.due_at = c.due_at;
        -- Their own trigger runs once each, one level down: it finds its cancelling
        -- dependents already cancelled and releases those that run on failure.
    END IF;
    FOR k IN 1 .. cardinality(ids) LOOP
        PERFORM duetime.release_if_ready(ids[k], dues[k]);
    END LOOP;
    RETURN NULL;
END $$;

ALTER FUNCTION duetime.jobs_check_dependencies() SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION duetime.jobs_add_dependencies() SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION duetime.release_if_ready(bigint, timestamptz)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION duetime.dependency_outcomes(bigint[]) SET plan_cache_mode = force_generic_plan;
