-- duetime 0025: workflows — jobs that wait for other jobs (DESIGN §16; docs/api.md
-- "Workflows" and "Coming from Celery canvas").
--
-- Producer-settable columns (plain SQL), each with a constant default or none, so adding
-- them rewrites no bucket; every CHECK is added NOT VALID and validated after, which
-- scans each bucket once under a SHARE UPDATE EXCLUSIVE lock but rewrites nothing:
--
--   depends_on            bigint[]  ids of jobs this one waits for (NULL/empty: none)
--   on_dependency_failure text      'cancel' (default) | 'run'
--   workflow_id           bigint    groups the jobs of one workflow (CLI, dashboard)
--
-- and one system-owned flag, has_dependents (some job waits for this one), which keeps
-- the release trigger's WHEN false — so free — for every job nobody waits for.
--
-- The status CHECK jobs_status_invalid (0001) gains `waiting`: the constraint is dropped
-- and added again under the same name NOT VALID, then VALIDATEd (a scan, no rewrite).
--
-- How it works
--
--   * Insert (BEFORE INSERT trigger, only for rows with depends_on): every dependency
--     must be an existing row of this database — which is the shard (a workflow's jobs
--     are inserted through one shard's store: JobStore/SyncJobStore are one shard's) —
--     else the insert fails with foreign_key_violation, constraint
--     jobs_depends_on_missing. The rows are locked FOR SHARE (a settlement racing the
--     insert commits first or waits for it). If a dependency already failed (dead or
--     cancelled) and the job cancels on failure, it is inserted `cancelled` with the
--     reason; if some are unfinished it is inserted `waiting`, its unfinished
--     dependencies get has_dependents, and (AFTER INSERT) one edge per unfinished
--     dependency goes into duetime.job_dependencies; otherwise it is plain `pending`.
--
--   * No cycle can exist: a job's dependencies are rows that existed before it was
--     inserted (the BEFORE trigger looks them up; the row being inserted is not yet
--     visible, so it cannot name itself), and depends_on cannot be changed after the
--     insert (no UPDATE privilege on it for anyone but the owner, and nothing updates
--     it). So every edge points from a newer row to an older one in commit order: the
--     "inserted before" relation is a strict order, and a cycle would need a row
--     inserted before itself.
--
--   * Release (AFTER UPDATE trigger on the transition into succeeded/dead/cancelled,
--     WHEN the row has_dependents or was waiting): the settling transaction deletes its
--     edges and releases every dependent left with none — `waiting` -> `pending` with
--     run_at = greatest(now(), due_at) (its run time counts from then), and a NOTIFY on
--     duetime_jobs so the dispatcher claims it at once. The UPDATE only changes a row
--     still `waiting`: never twice. It commits or rolls back with the outcome: never
--     lost across crashes (a retried dependency goes back to `pending`, which fires
--     nothing: its dependents keep waiting).
--
--     Exactness without a hot counter row: each completion deletes only its own edge
--     (no two settlements write the same row) and then looks for a remaining edge of the
--     dependent (an index probe, newest dependency first, so a fan-in's completed
--     members — the oldest ids — are not walked). Three cases:
--       1. none left: release;
--       2. one left that nobody is settling (FOR KEY SHARE SKIP LOCKED finds it): that
--          dependency's DELETE now waits for this commit, so its own probe runs after
--          it and sees this edge gone — it is not our job to release;
--       3. every remaining edge is being deleted by a concurrent settlement: lock the
--          dependent row (the only serialisation point, and only at the tail of a
--          fan-in), probe again with a fresh snapshot, release if none are left. Each
--          of the concurrent settlers reaches case 1 or 3 and takes the same lock, so
--          the last to get it sees every other deletion committed.
--     Cost per member completion of a fan-in: one edge DELETE, one or two index probes,
--     independent of the number of members (docs/benchmarks.md, "Workflows").
--
--   * Failure: a dependency ending dead or cancelled cancels its waiting dependents
--     whose on_dependency_failure is 'cancel' (cancelled_by 'dependency', last_error
--     naming the failed job: "dependency 12 (resize) dead: ..."), and their own
--     trigger cancels theirs, transitively; 'run' dependents treat the failure as an
--     outcome and are released when nothing else is unfinished (ctx.dependencies shows
--     the failed status).
--
--   * The worker reads a job's dependencies (id, task, status, result, error) in the
--     statement that begins the attempt (worker_begin_flow: worker_begin_traced plus
--     one jsonb column, NULL for a job without depends_on): no extra round trip.

ALTER TABLE duetime.jobs ADD COLUMN depends_on bigint[];
ALTER TABLE duetime.jobs ADD COLUMN on_dependency_failure text NOT NULL DEFAULT 'cancel';
ALTER TABLE duetime.jobs ADD COLUMN workflow_id bigint;
ALTER TABLE duetime.jobs ADD COLUMN has_dependents boolean NOT NULL DEFAULT false;

ALTER TABLE duetime.jobs DROP CONSTRAINT jobs_status_invalid;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_status_invalid CHECK (
    status IN ('pending', 'dispatched', 'succeeded', 'dead', 'cancelled', 'waiting'))
    NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_depends_on_invalid
    CHECK (depends_on IS NULL
           OR (array_ndims(depends_on) IS NULL
               OR (array_ndims(depends_on) = 1 AND cardinality(depends_on) <= 100000
                   AND array_position(depends_on, NULL) IS NULL))) NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_on_dependency_failure_invalid
    CHECK (on_dependency_failure IN ('cancel', 'run')) NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_workflow_id_invalid
    CHECK (workflow_id IS NULL OR workflow_id > 0) NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_waiting_without_dependencies
    CHECK (status <> 'waiting' OR coalesce(cardinality(depends_on), 0) > 0) NOT VALID;
-- A unique key is held from insert to outcome by triggers of migration 0014 that know
-- only pending and dispatched; a waiting job holding one would keep it past a cancel.
-- Until they learn `waiting`, the two do not go together.
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_unique_key_with_depends_on
    CHECK (unique_key IS NULL OR depends_on IS NULL) NOT VALID;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_status_invalid;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_unique_key_with_depends_on;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_depends_on_invalid;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_on_dependency_failure_invalid;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_workflow_id_invalid;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_waiting_without_dependencies;

COMMENT ON COLUMN duetime.jobs.depends_on IS
    'ids of existing jobs (same database) this job waits for; it is waiting until all end';
COMMENT ON COLUMN duetime.jobs.on_dependency_failure IS
    'cancel (default): a dependency ending dead/cancelled cancels this job; run: run anyway';
COMMENT ON COLUMN duetime.jobs.workflow_id IS
    'groups the jobs of one workflow (nextval(''duetime.workflow_id_seq'') or any id > 0)';
COMMENT ON COLUMN duetime.jobs.has_dependents IS
    'system: some job was inserted waiting for this one (keeps the release trigger free)';

CREATE SEQUENCE duetime.workflow_id_seq AS bigint;

-- Waiting jobs (status, metrics, the maintainer's liveness test) and a workflow's jobs.
CREATE INDEX jobs_waiting_idx ON duetime.jobs (id) WHERE status = 'waiting';
CREATE INDEX jobs_workflow_idx ON duetime.jobs (workflow_id) WHERE workflow_id IS NOT NULL;

-- The unfinished edges: one row per (waiting job, dependency not yet ended). Rows go
-- when the dependency ends (or the dependent is cancelled); an empty set of rows for a
-- `waiting` job is what "ready" means.
CREATE TABLE duetime.job_dependencies (
    dependent_id     bigint      NOT NULL,
    dependent_due_at timestamptz NOT NULL,
    dependency_id    bigint      NOT NULL,
    CONSTRAINT job_dependencies_pkey PRIMARY KEY (dependent_id, dependency_id)
);
CREATE INDEX job_dependencies_dependency_idx ON duetime.job_dependencies (dependency_id);

-- A bucket holding a waiting job is live: it must not be detached.
CREATE OR REPLACE FUNCTION duetime.partition_is_live(part regclass) RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    live boolean;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_inherits
                    WHERE inhrelid = part AND inhparent = 'duetime.jobs'::regclass) THEN
        RAISE EXCEPTION 'not a partition of duetime.jobs: %', part;
    END IF;
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM %1$s WHERE status = ''pending'') '
        '    OR EXISTS (SELECT 1 FROM %1$s WHERE status = ''dispatched'')'
        '    OR EXISTS (SELECT 1 FROM %1$s WHERE status = ''waiting'')', part)
        INTO live;
    RETURN live;
END $$;

-- BEFORE INSERT, rows with depends_on only: check, lock and classify the dependencies.
CREATE FUNCTION duetime.jobs_check_dependencies() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    wanted bigint[];
    seen bigint[];
    missing bigint;
    failed record;
    open_ids bigint[];
BEGIN
    IF NEW.status <> 'pending' OR coalesce(cardinality(NEW.depends_on), 0) = 0
       OR array_ndims(NEW.depends_on) <> 1 OR cardinality(NEW.depends_on) > 100000
       OR array_position(NEW.depends_on, NULL) IS NOT NULL THEN
        RETURN NEW;  -- nothing to wait for, or a shape jobs_depends_on_invalid refuses
    END IF;
    wanted := ARRAY(SELECT DISTINCT d FROM unnest(NEW.depends_on) AS d ORDER BY d);
    -- FOR SHARE: a settlement of one of them (FOR NO KEY UPDATE) commits before this
    -- statement reads it, or waits for this transaction; the status read stays true.
    SELECT array_agg(j.id ORDER BY j.id),
           array_agg(j.id ORDER BY j.id)
               FILTER (WHERE j.status IN ('pending', 'dispatched', 'waiting'))
      INTO seen, open_ids
      FROM (SELECT id, status FROM duetime.jobs WHERE id = ANY(wanted) FOR SHARE) j;
    SELECT w INTO missing FROM unnest(wanted) AS w
     WHERE seen IS NULL OR NOT w = ANY(seen) LIMIT 1;
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'dependency % of the new job does not exist (in this database)',
              missing
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'jobs_depends_on_missing',
                  TABLE = 'jobs', SCHEMA = 'duetime',
                  HINT = 'depends_on takes ids of jobs already inserted in the same shard';
    END IF;
    SELECT j.id, j.task, j.status, j.last_error INTO failed
      FROM duetime.jobs j
     WHERE j.id = ANY(wanted) AND j.status IN ('dead', 'cancelled')
     ORDER BY j.id LIMIT 1;
    IF FOUND AND NEW.on_dependency_failure = 'cancel' THEN
        NEW.status := 'cancelled';
        NEW.finished_at := now();
        NEW.cancelled_by := 'dependency';
        NEW.last_error := left(format('dependency %s (%s) %s', failed.id, failed.task,
                                      failed.status)
                               || coalesce(': ' || failed.last_error, ''), 2000);
        RETURN NEW;
    END IF;
    IF open_ids IS NOT NULL THEN
        NEW.status := 'waiting';
        UPDATE duetime.jobs SET has_dependents = true
         WHERE id = ANY(open_ids) AND NOT has_dependents;
    END IF;
    RETURN NEW;
END $$;

-- AFTER INSERT of a waiting row: its edges (the rows stay locked by the BEFORE trigger).
CREATE FUNCTION duetime.jobs_add_dependencies() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO duetime.job_dependencies (dependent_id, dependent_due_at, dependency_id)
    SELECT DISTINCT NEW.id, NEW.due_at, j.id
      FROM duetime.jobs j
     WHERE j.id = ANY(NEW.depends_on) AND j.status IN ('pending', 'dispatched', 'waiting')
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;

-- Release `dependent` if no edge of it is left (the three cases of the header).
CREATE FUNCTION duetime.release_if_ready(dependent bigint, dependent_due timestamptz)
    RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM 1 FROM duetime.job_dependencies
     WHERE dependent_id = dependent ORDER BY dependency_id DESC LIMIT 1;
    IF FOUND THEN
        PERFORM 1 FROM duetime.job_dependencies
         WHERE dependent_id = dependent ORDER BY dependency_id DESC LIMIT 1
           FOR KEY SHARE SKIP LOCKED;
        IF FOUND THEN
            RETURN false;  -- case 2: that dependency's settlement probes after us
        END IF;
        -- case 3: every edge left is being deleted right now; serialise on the row
        PERFORM 1 FROM duetime.jobs
         WHERE id = dependent AND due_at = dependent_due + interval '0' FOR UPDATE;
        PERFORM 1 FROM duetime.job_dependencies WHERE dependent_id = dependent LIMIT 1;
        IF FOUND THEN
            RETURN false;
        END IF;
    END IF;
    UPDATE duetime.jobs
       SET status = 'pending', run_at = greatest(now(), due_at)
     WHERE id = dependent AND due_at = dependent_due + interval '0' AND status = 'waiting';
    IF FOUND THEN
        PERFORM pg_notify('duetime_jobs', 'released');
        RETURN true;
    END IF;
    RETURN false;
END $$;

-- AFTER UPDATE into an outcome, for a row somebody waits for or a waiting row.
CREATE FUNCTION duetime.jobs_release_dependents() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    ids bigint[];
    dues timestamptz[];
    reason text;
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
        -- their own rows' trigger (OLD.status = 'waiting') cascades further
        UPDATE duetime.jobs j
           SET status = 'cancelled', finished_at = now(), cancelled_by = 'dependency',
               last_error = reason
          FROM (SELECT r.id, r.due_at FROM duetime.jobs r
                  JOIN unnest(ids, dues) AS d(id, due_at)
                    ON r.id = d.id AND r.due_at = d.due_at
                 WHERE r.status = 'waiting' AND r.on_dependency_failure = 'cancel'
                 ORDER BY r.id
                   FOR UPDATE OF r) c
         WHERE j.id = c.id AND j.due_at = c.due_at;
    END IF;
    FOR k IN 1 .. cardinality(ids) LOOP
        PERFORM duetime.release_if_ready(ids[k], dues[k]);
    END LOOP;
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_check_dependencies BEFORE INSERT ON duetime.jobs
    FOR EACH ROW WHEN (NEW.depends_on IS NOT NULL)
    EXECUTE FUNCTION duetime.jobs_check_dependencies();
CREATE TRIGGER jobs_add_dependencies AFTER INSERT ON duetime.jobs
    FOR EACH ROW WHEN (NEW.status = 'waiting')
    EXECUTE FUNCTION duetime.jobs_add_dependencies();
CREATE TRIGGER jobs_release_dependents AFTER UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN ((NEW.has_dependents OR OLD.status = 'waiting')
          AND OLD.status IN ('pending', 'dispatched', 'waiting')
          AND NEW.status IN ('succeeded', 'dead', 'cancelled'))
    EXECUTE FUNCTION duetime.jobs_release_dependents();

-- A waiter (JobStore.result) on a waiting job hears of its cancel too.
DROP TRIGGER jobs_notify_finished ON duetime.jobs;
CREATE TRIGGER jobs_notify_finished AFTER UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (OLD.status IN ('pending', 'dispatched', 'waiting')
          AND NEW.status IN ('succeeded', 'dead', 'cancelled'))
    EXECUTE FUNCTION duetime.notify_job_finished();

-- worker_begin_traced (0023) plus the job's dependencies, as a JSON array of
-- {id, task, status, result, error} in depends_on order (NULL: no depends_on).
CREATE FUNCTION duetime.worker_begin_flow(job_ids bigint[], due_ats timestamptz[],
                                          attempts integer[], epochs bigint[],
                                          release_ids bigint[], release_attempts integer[],
                                          release_epochs bigint[])
    RETURNS TABLE (i bigint, status text, attempt integer, max_attempts integer,
                   queue text, task text, payload jsonb, key text, run_time timestamptz,
                   done boolean, epoch bigint, started boolean, timeout_s float8,
                   traceparent text, enqueued_at timestamptz, dependencies jsonb)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    IF cardinality(release_ids) > 0 THEN
        PERFORM duetime.worker_release(release_ids, release_attempts, release_epochs);
    END IF;
    RETURN QUERY
    SELECT w.i, j.status, j.attempt, j.max_attempts, j.queue, j.task, j.payload,
           j.effective_key, j.run_time,
           EXISTS (SELECT 1 FROM duetime.job_ledger l
                    WHERE l.idempotency_key = j.effective_key),
           j.dispatch_epoch,
           CASE WHEN j.status = 'dispatched' AND j.attempt = w.attempt
                     AND j.dispatch_epoch = w.epoch
                THEN pg_try_advisory_lock(
                         (duetime.attempt_guard(w.id, w.attempt, w.epoch) >> 32)::integer,
                         ((duetime.attempt_guard(w.id, w.attempt, w.epoch) & 4294967295)
                          - 2147483648)::integer)
           END,
           j.timeout_s, j.traceparent, j.created_at,
           CASE WHEN j.depends_on IS NOT NULL THEN
               (SELECT coalesce(jsonb_agg(jsonb_build_object(
                           'id', d.id, 'task', d.task, 'status', d.status,
                           'result', d.result, 'error', d.last_error) ORDER BY d.id), '[]')
                  FROM duetime.jobs d
                 WHERE d.id = ANY(j.depends_on))
           END
      FROM unnest(job_ids, due_ats, attempts, epochs)
               WITH ORDINALITY AS w(id, due_at, attempt, epoch, i)
     CROSS JOIN LATERAL (
            SELECT r.status, r.attempt, r.max_attempts, r.queue, r.task, r.payload,
                   r.dispatch_epoch, r.timeout_s, r.traceparent, r.created_at,
                   r.depends_on,
                   duetime.effective_key(r.id, r.idempotency_key, r.schedule_id,
                                         r.created_by) AS effective_key,
                   coalesce(r.run_at, r.due_at) AS run_time
              FROM duetime.jobs r
             WHERE r.id = w.id AND r.due_at = w.due_at
               FOR KEY SHARE
           ) j;
END $$;

REVOKE EXECUTE ON FUNCTION duetime.worker_begin_flow(bigint[], timestamptz[], integer[],
                                                    bigint[], bigint[], integer[], bigint[])
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.release_if_ready(bigint, timestamptz) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.jobs_check_dependencies() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.jobs_add_dependencies() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.jobs_release_dependents() FROM PUBLIC;
