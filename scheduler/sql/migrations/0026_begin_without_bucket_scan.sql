-- duetime 0026: the begin statement no longer plans a read of every bucket
-- (docs/benchmarks.md, "Workflows: the begin statement").
--
-- worker_begin_flow (0025) read a job's dependencies in a subquery of its one statement:
-- `d.id = ANY(j.depends_on)` cannot be pruned by due time, so every call's plan held a
-- scan of every bucket of duetime.jobs, initialised (and its buckets opened) on every
-- execution although the CASE never ran it for a job without depends_on. Measured in
-- the storm (20,000 jobs, one worker at concurrency 64): PostgreSQL spent 2.9-3.0 ms of
-- CPU per job against 2.4 with the begin of 0023. The read now lives in its own
-- function, called only for a job that has depends_on, whose plan PL/pgSQL caches per
-- session: a job without dependencies pays nothing for it.
--
-- CREATE OR REPLACE keeps worker_begin_flow's owner and grants (roles.sql); the new
-- function is executed only by it (SECURITY DEFINER: the owner's rights), so PUBLIC
-- loses EXECUTE.

-- The outcomes of the jobs `ids`: a JSON array of {id, task, status, result, error} in
-- id order (ctx.dependencies), '[]' when none exists any more.
CREATE FUNCTION duetime.dependency_outcomes(ids bigint[]) RETURNS jsonb
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT coalesce(jsonb_agg(jsonb_build_object(
                       'id', d.id, 'task', d.task, 'status', d.status,
                       'result', d.result, 'error', d.last_error) ORDER BY d.id), '[]')
              FROM duetime.jobs d
             WHERE d.id = ANY(ids));
END $$;

REVOKE EXECUTE ON FUNCTION duetime.dependency_outcomes(bigint[]) FROM PUBLIC;

CREATE OR REPLACE FUNCTION duetime.worker_begin_flow(job_ids bigint[], due_ats timestamptz[],
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
           CASE WHEN j.depends_on IS NOT NULL
                THEN duetime.dependency_outcomes(j.depends_on) END
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
