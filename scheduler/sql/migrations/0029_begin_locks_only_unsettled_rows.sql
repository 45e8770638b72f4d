-- duetime 0029: the worker's begin locks only the rows it must wait for.
--
-- worker_begin_flow (0025, 0026) read every delivery's row FOR KEY SHARE. The lock is
-- there for one case: the dispatcher publishes before its claim commits, so a delivery
-- can arrive while the claim still holds the row, and the begin must wait for that
-- commit to see the row `dispatched` (else it would ack the message as "not this
-- attempt's" and leave the job to the reconciler). A row lock, though, is a write: it
-- takes a transaction id, writes the tuple's xmax (a WAL record, the page dirtied) and
-- makes the autocommit statement commit with a WAL flush. Measured on 8,000 dispatched
-- rows in waves of 64 (docs/benchmarks.md, "Fewer writes per job"): 205 bytes of WAL
-- per job for the lock, and ~1 byte without it.
--
-- Now one statement reads each row without a lock first (`s`), and locks, FOR KEY
-- SHARE, only the rows that are not yet what the message says (`unsettled`: not
-- `dispatched` at this attempt and epoch in the statement's snapshot, i.e. possibly a
-- claim in flight, or simply a row the message is not for). The lock's subquery is
-- gated by `s.unsettled` alone, so for a settled row it does not run at all; for an
-- unsettled one it waits for the claim, and READ COMMITTED's re-check returns the row
-- as the claim committed it. What the worker decides from (status, attempt, epoch,
-- run time) comes from the locked read where there is one. A row the snapshot already
-- shows `dispatched` at this attempt and epoch was committed so by its claim: there is
-- nothing to wait for. A cancel or a settlement racing the begin is no longer waited
-- for either: the begin then sees the row as it was before it, exactly as if it had
-- run a moment earlier, and the cancel reaches the running handler (workers/cancel.py)
-- or the settlement finds the row moved on, as for any cancel during a run.
--
-- Same signature, owner and grants (CREATE OR REPLACE).

CREATE OR REPLACE FUNCTION duetime.worker_begin_flow(job_ids bigint[], due_ats timestamptz[],
    attempts integer[], epochs bigint[], release_ids bigint[], release_attempts integer[], release_epochs bigint[])
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
           EXISTS (SELECT 1 FROM duetime.job_ledger l WHERE l.idempotency_key = j.effective_key),
           j.dispatch_epoch,
           CASE WHEN j.status = 'dispatched' AND j.attempt = w.attempt AND j.dispatch_epoch = w.epoch
                THEN pg_try_advisory_lock(
                         (duetime.attempt_guard(w.id, w.attempt, w.epoch) >> 32)::integer,
                         ((duetime.attempt_guard(w.id, w.attempt, w.epoch) & 4294967295) - 2147483648)::integer)
           END,
           j.timeout_s, j.traceparent, j.created_at,
           CASE WHEN j.depends_on IS NOT NULL THEN duetime.dependency_outcomes(j.depends_on) END
      FROM unnest(job_ids, due_ats, attempts, epochs) WITH ORDINALITY AS w(id, due_at, attempt, epoch, i)
     CROSS JOIN LATERAL (
            SELECT r.*, NOT (r.status = 'dispatched' AND r.attempt = w.attempt
                             AND r.dispatch_epoch IS NOT DISTINCT FROM w.epoch) AS unsettled
              FROM duetime.jobs r
             WHERE r.id = w.id AND r.due_at = w.due_at
           ) s
      LEFT JOIN LATERAL (
            SELECT r.* FROM duetime.jobs r
             WHERE s.unsettled AND r.id = w.id AND r.due_at = w.due_at
               FOR KEY SHARE
           ) l ON true
     CROSS JOIN LATERAL (
            SELECT CASE WHEN s.unsettled THEN l.status ELSE s.status END AS status,
                   CASE WHEN s.unsettled THEN l.attempt ELSE s.attempt END AS attempt,
                   CASE WHEN s.unsettled THEN l.max_attempts ELSE s.max_attempts END AS max_attempts,
                   s.queue, s.task, s.payload,
                   CASE WHEN s.unsettled THEN l.dispatch_epoch ELSE s.dispatch_epoch END AS dispatch_epoch,
                   s.timeout_s, s.traceparent, s.created_at, s.depends_on,
                   duetime.effective_key(s.id, s.idempotency_key, s.schedule_id, s.created_by) AS effective_key,
                   CASE WHEN s.unsettled THEN coalesce(l.run_at, l.due_at) ELSE coalesce(s.run_at, s.due_at) END AS run_time
           ) j;
END $$;
