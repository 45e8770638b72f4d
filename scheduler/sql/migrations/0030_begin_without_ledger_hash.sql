-- duetime 0030: the begin read no longer hashes the whole ledger
-- (docs/benchmarks.md, "The begin read and the ledger it looked up").
--
-- worker_begin_flow (0026) answered `done` with EXISTS (a ledger row with the job's
-- key). PostgreSQL may run such an EXISTS as a hashed subplan: read all of
-- duetime.job_ledger into a hash table, then probe it once per row. The plan is made
-- once per session (a generic plan: the worker's store pool forces one) from the
-- statistics of that moment: with a small or never analysed ledger (a new install, a
-- worker that started before a storm) the hash is chosen and kept while the ledger
-- grows, so every begin read scanned every ledger row until an ANALYZE replaced the
-- plan. Measured: 0.035 ms of PostgreSQL CPU per delivery (8 per statement) with an
-- empty ledger, 0.32 ms once it held 20,000 rows; in the 20,000-job storm the begin read
-- spent 58 % of its CPU building that hash.
--
-- A scalar subquery is never hashed: `done` is now the ledger row looked up by its
-- primary key (at most one row) for each job, whatever the statistics say. Same
-- answer: true when the ledger holds the key, false when it does not.
--
-- The function also carries plan_cache_mode = force_generic_plan itself, so that its
-- plan is kept per session however the session is configured. Through a transaction
-- pooler (DUETIME_DATABASE_POOLER=transaction) the store pool cannot send that setting,
-- and the statement was planned again at every call (about 1 ms for 8 deliveries with
-- 17 buckets, most of it reading the buckets' CHECK constraints).
--
-- CREATE OR REPLACE keeps the function's owner and grants (roles.sql).

CREATE OR REPLACE FUNCTION duetime.worker_begin_flow(job_ids bigint[], due_ats timestamptz[],
                                          attempts integer[], epochs bigint[],
                                          release_ids bigint[], release_attempts integer[],
                                          release_epochs bigint[])
    RETURNS TABLE (i bigint, status text, attempt integer, max_attempts integer,
                   queue text, task text, payload jsonb, key text, run_time timestamptz,
                   done boolean, epoch bigint, started boolean, timeout_s float8,
                   traceparent text, enqueued_at timestamptz, dependencies jsonb)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
BEGIN
    IF cardinality(release_ids) > 0 THEN
        PERFORM duetime.worker_release(release_ids, release_attempts, release_epochs);
    END IF;
    RETURN QUERY
    SELECT w.i, j.status, j.attempt, j.max_attempts, j.queue, j.task, j.payload,
           j.effective_key, j.run_time,
           coalesce((SELECT true FROM duetime.job_ledger l
                      WHERE l.idempotency_key = j.effective_key), false),
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

