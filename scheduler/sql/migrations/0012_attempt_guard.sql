-- duetime 0012: at most one worker process runs an attempt at a time (docs/security.md,
-- "Forged, copied and stale messages").
--
-- Two worker processes that each receive a copy of the current message (same job, due
-- time, attempt and dispatch epoch) at the same instant used to run the handler twice:
-- each process knew only its own running deliveries. "This attempt has started" is now a
-- session-level advisory lock, taken by the begin read itself on the executor's guard
-- connection (scheduler/store/execution.py, AttemptGuard) and held there until the
-- attempt is settled. Why a session lock on one long-lived connection, and not a row or
-- transaction lock held by the attempt's own transaction: attempts whose handlers never
-- use ctx.db have no transaction and no connection (they are read and settled in
-- batches); giving each one for its whole run would cost a connection per running
-- handler and two round trips per delivery. Why a lock and not a "started by" column:
-- PostgreSQL releases the lock itself when the holder's connection ends (a worker
-- killed, a connection lost), so a copy redelivered after the runner died runs; a column
-- would need a liveness protocol of its own, and a write per delivery.
--
-- The lock key is duetime.attempt_guard(id, attempt, epoch): a 64-bit hash, locked with
-- the two-int4 form of the advisory lock functions, whose key space (objsubid 2) is
-- apart from the bigint form handlers typically use (pg_advisory_xact_lock(bigint)).
-- A collision with another attempt's key (2^-64 per pair) only delays that attempt: its
-- copy is acked or requeued as "running", the row stays dispatched, and the reconciler
-- publishes it again.

CREATE FUNCTION duetime.attempt_guard(job_id bigint, job_attempt integer, job_epoch bigint)
    RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
    SELECT hashtextextended(job_id::text || ':' || job_attempt::text || ':'
                            || coalesce(job_epoch::text, ''), 20261203)
$$;

-- Release the guards of attempts this session started (after their outcome committed,
-- or when they end without one: the message goes back to the queue and its next
-- delivery may run). One unlock per attempt: a guard is held once per start. A pointer
-- whose guard this session does not hold is ignored (the begin that failed half-way
-- releases every pointer of its batch); the server's warning for it is not sent to the
-- client. Returns how many were released.
CREATE FUNCTION duetime.worker_release(job_ids bigint[], attempts integer[], epochs bigint[])
    RETURNS integer
    LANGUAGE sql SET search_path = pg_catalog, pg_temp SET client_min_messages = error AS $$
    SELECT count(*) FILTER (WHERE pg_advisory_unlock((g >> 32)::integer,
                                                     ((g & 4294967295) - 2147483648)::integer))::integer
      FROM unnest(job_ids, attempts, epochs) AS w(id, attempt, epoch)
     CROSS JOIN LATERAL duetime.attempt_guard(w.id, w.attempt, w.epoch) AS g
$$;

-- worker_begin (0009) plus the guard: `started` is true when this call took the
-- attempt's lock (the caller runs it, then releases it: with worker_release, or in the
-- release arrays of its next worker_begin, which releases them first, so that a busy
-- worker sends no statement of its own for releases), false when
-- another session holds it (a copy of a running attempt: not run), NULL when the row is
-- not this message's to run (missing, not dispatched, another attempt or dispatch) and
-- no lock was tried. The lock is tried after the row was read FOR KEY SHARE, i.e. after
-- any in-flight claim committed.
CREATE FUNCTION duetime.worker_begin(job_ids bigint[], due_ats timestamptz[],
                                     attempts integer[], epochs bigint[],
                                     release_ids bigint[], release_attempts integer[],
                                     release_epochs bigint[])
    RETURNS TABLE (i bigint, status text, attempt integer, max_attempts integer,
                   queue text, task text, payload jsonb, key text, run_time timestamptz,
                   done boolean, epoch bigint, started boolean)
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
           END
      FROM unnest(job_ids, due_ats, attempts, epochs)
               WITH ORDINALITY AS w(id, due_at, attempt, epoch, i)
     CROSS JOIN LATERAL (
            SELECT r.status, r.attempt, r.max_attempts, r.queue, r.task, r.payload,
                   r.dispatch_epoch,
                   duetime.effective_key(r.id, r.idempotency_key, r.schedule_id,
                                         r.created_by) AS effective_key,
                   coalesce(r.run_at, r.due_at) AS run_time
              FROM duetime.jobs r
             WHERE r.id = w.id AND r.due_at = w.due_at
               FOR KEY SHARE
           ) j;
END $$;

REVOKE EXECUTE ON FUNCTION duetime.attempt_guard(bigint, integer, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_begin(bigint[], timestamptz[], integer[], bigint[],
                                               bigint[], integer[], bigint[])
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_release(bigint[], integer[], bigint[]) FROM PUBLIC;
