-- duetime 0019: job control (DESIGN §12; docs/api.md "Job control").
--
-- New columns of duetime.jobs, each with a constant default (or none), so adding them
-- rewrites no bucket; each CHECK is added NOT VALID (no scan under the ACCESS
-- EXCLUSIVE lock) and validated after, under a SHARE UPDATE EXCLUSIVE lock only:
--
--   result        jsonb   what the handler returned, committed with `succeeded`
--   cancelled_by  text    who cancelled the job (the role, or the name a tool gave)
--   snoozes       integer how often a handler snoozed the job (Snooze: no attempt used)
--   max_snoozes   integer the bound on snoozes (producer-settable, default 100)
--   timeout_s     float8  the handler's time limit for this job (producer-settable;
--                         overrides the task's timeout)
--   progress      real    how far the running handler got, 0..1 (ctx.progress)
--   progress_note text    what it said about it (at most 200 characters)
--   progress_at   timestamptz  when it last said so
--
-- The worker role still holds no table privilege (migration 0009): every new worker
-- statement is a SECURITY DEFINER function that changes only a row `dispatched` at the
-- attempt named. The result is written by new overloads of the three settling functions
-- (an extra argument: the results, NULL for none), so a worker of the previous release
-- keeps working during a rolling deploy.
--
-- Cancel of a running job: the operator's UPDATE (jobs.sql `cancel`) moves the row to
-- `cancelled`, and the same transaction NOTIFYs `duetime_cancel` with the ids; every
-- worker LISTENs there and cancels the handler it runs. The settling functions change
-- only `dispatched` rows, so a settlement after the cancel finds nothing to settle and
-- rolls back the handler's writes (finish_attempt: DT001); a cancel after the
-- settlement committed finds a finished row and is refused. Whichever commits first
-- wins the row lock; the other loses cleanly.
--
-- Waiting for a result (JobStore.result): a waiter registers its job id in
-- duetime.result_waiters and LISTENs on `duetime_job_finished`; the trigger below
-- NOTIFYs only for finished jobs somebody waits for, so jobs nobody waits for pay one
-- index probe of a small table and no NOTIFY (a NOTIFY serialises commits on
-- PostgreSQL's notify queue lock).

ALTER TABLE duetime.jobs ADD COLUMN result jsonb;
ALTER TABLE duetime.jobs ADD COLUMN cancelled_by text;
ALTER TABLE duetime.jobs ADD COLUMN snoozes integer NOT NULL DEFAULT 0;
ALTER TABLE duetime.jobs ADD COLUMN max_snoozes integer NOT NULL DEFAULT 100;
ALTER TABLE duetime.jobs ADD COLUMN timeout_s float8;
ALTER TABLE duetime.jobs ADD COLUMN progress real;
ALTER TABLE duetime.jobs ADD COLUMN progress_note text;
ALTER TABLE duetime.jobs ADD COLUMN progress_at timestamptz;

ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_result_too_large
    CHECK (result IS NULL OR octet_length(result::text) <= 67108864) NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_cancelled_by_too_long
    CHECK (cancelled_by IS NULL OR length(cancelled_by) <= 200) NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_snoozes_out_of_range
    CHECK (snoozes >= 0) NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_max_snoozes_out_of_range
    CHECK (max_snoozes BETWEEN 0 AND 10000) NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_timeout_s_out_of_range
    CHECK (timeout_s IS NULL OR (timeout_s > 0 AND timeout_s <= 604800)) NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_progress_out_of_range
    CHECK (progress IS NULL OR progress BETWEEN 0 AND 1) NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_progress_note_too_long
    CHECK (progress_note IS NULL OR length(progress_note) <= 200) NOT VALID;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_result_too_large;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_progress_out_of_range;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_progress_note_too_long;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_cancelled_by_too_long;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_snoozes_out_of_range;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_max_snoozes_out_of_range;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_timeout_s_out_of_range;

COMMENT ON COLUMN duetime.jobs.result IS
    'what the handler returned (JSON), set with status succeeded; NULL: nothing returned';
COMMENT ON COLUMN duetime.jobs.cancelled_by IS 'who cancelled the job';
COMMENT ON COLUMN duetime.jobs.snoozes IS 'times a handler snoozed the job (no attempt used)';
COMMENT ON COLUMN duetime.jobs.max_snoozes IS
    'snoozes allowed (0..10000, default 100); one more is a failed attempt';
COMMENT ON COLUMN duetime.jobs.progress IS
    'how far the handler got (0..1), as it last reported (ctx.progress); kept after it ends';
COMMENT ON COLUMN duetime.jobs.progress_note IS 'the note of the last progress report';
COMMENT ON COLUMN duetime.jobs.timeout_s IS
    'seconds the handler may run for this job (0 < s <= 7 days); overrides the task timeout';

-- Who waits for which job's outcome. UNLOGGED: a waiter lives as long as its session, a
-- crash loses nothing worth keeping. A waiter whose client died leaves a row that only
-- causes a NOTIFY nobody hears; result() deletes its own row when it returns, and rows
-- older than a day are removed by every new registration.
CREATE UNLOGGED TABLE duetime.result_waiters (
    job_id bigint      NOT NULL,
    since  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX result_waiters_job_idx ON duetime.result_waiters (job_id);

CREATE FUNCTION duetime.notify_job_finished() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM duetime.result_waiters w WHERE w.job_id = NEW.id) THEN
        PERFORM pg_notify('duetime_job_finished', NEW.id::text);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_notify_finished AFTER UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (OLD.status IN ('pending', 'dispatched')
          AND NEW.status IN ('succeeded', 'dead', 'cancelled'))
    EXECUTE FUNCTION duetime.notify_job_finished();

-- Register a waiter. The row lock (FOR SHARE, in the registering transaction) waits
-- for a settlement already in flight: that settlement's trigger may have looked for
-- waiters before this one was registered, so the waiter must read the row only after
-- it committed. A settlement that locks the row later runs its trigger after this
-- registration committed, and sees it. Without the wait a job settled in that window
-- would finish unnoticed (measured: one lost wake-up in ~200 round trips).
CREATE FUNCTION duetime.await_job(wait_id bigint) RETURNS void
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM duetime.result_waiters WHERE since < now() - interval '1 day';
    INSERT INTO duetime.result_waiters (job_id) VALUES (wait_id);
    SELECT 1 FROM duetime.jobs WHERE id = wait_id FOR SHARE;
$$;

CREATE FUNCTION duetime.unawait_job(wait_id bigint) RETURNS void
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM duetime.result_waiters
     WHERE ctid = (SELECT ctid FROM duetime.result_waiters WHERE job_id = wait_id LIMIT 1);
$$;

-- worker_begin (0012) plus the row's timeout_s: a new name, because a function's result
-- columns cannot change in place and the previous release's workers still call the old.
CREATE FUNCTION duetime.worker_begin_jobs(job_ids bigint[], due_ats timestamptz[],
                                          attempts integer[], epochs bigint[],
                                          release_ids bigint[], release_attempts integer[],
                                          release_epochs bigint[])
    RETURNS TABLE (i bigint, status text, attempt integer, max_attempts integer,
                   queue text, task text, payload jsonb, key text, run_time timestamptz,
                   done boolean, epoch bigint, started boolean, timeout_s float8)
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
           j.timeout_s
      FROM unnest(job_ids, due_ats, attempts, epochs)
               WITH ORDINALITY AS w(id, due_at, attempt, epoch, i)
     CROSS JOIN LATERAL (
            SELECT r.status, r.attempt, r.max_attempts, r.queue, r.task, r.payload,
                   r.dispatch_epoch, r.timeout_s,
                   duetime.effective_key(r.id, r.idempotency_key, r.schedule_id,
                                         r.created_by) AS effective_key,
                   coalesce(r.run_at, r.due_at) AS run_time
              FROM duetime.jobs r
             WHERE r.id = w.id AND r.due_at = w.due_at
               FOR KEY SHARE
           ) j;
END $$;

-- worker_complete (0009) with the results: results[n] is job n's, NULL for none.
CREATE FUNCTION duetime.worker_complete(job_ids bigint[], due_ats timestamptz[],
                                        attempts integer[], worker_name text,
                                        results jsonb[])
    RETURNS bigint[]
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    settled_ids bigint[];
BEGIN
    WITH done AS (
        SELECT * FROM unnest(job_ids, due_ats, attempts, results)
            AS d(id, due_at, attempt, result)
    ), settled AS (
        UPDATE duetime.jobs j
           SET status = 'succeeded', finished_at = now(), result = d.result
          FROM done d
         WHERE j.id = ANY(job_ids) AND j.due_at = ANY(due_ats)
           AND j.id = d.id AND j.due_at = d.due_at
           AND j.status = 'dispatched' AND j.attempt = d.attempt
        RETURNING j.id, d.attempt, j.task,
                  duetime.effective_key(j.id, j.idempotency_key, j.schedule_id,
                                        j.created_by) AS key
    ), ledger AS (
        INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker)
        SELECT s.key, s.id, s.attempt, s.task, worker_name FROM settled s
        ON CONFLICT (idempotency_key) DO NOTHING
    )
    SELECT coalesce(array_agg(s.id), '{}') INTO settled_ids FROM settled s;
    RETURN settled_ids;
END $$;

-- worker_finish_group (0009) with the results.
CREATE FUNCTION duetime.worker_finish_group(job_ids bigint[], due_ats timestamptz[],
                                            attempts integer[], worker_name text,
                                            first_due timestamptz, last_due timestamptz,
                                            results jsonb[])
    RETURNS TABLE (i bigint, settled boolean, recorded boolean)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH done AS (
        SELECT * FROM unnest(job_ids, due_ats, attempts, results)
            WITH ORDINALITY AS d(id, due_at, attempt, result, i)
    ), settled AS (
        UPDATE duetime.jobs j
           SET status = 'succeeded', finished_at = now(), result = d.result
          FROM done d
         WHERE j.id = ANY(job_ids)
           AND j.due_at >= first_due + interval '0'
           AND j.due_at <= last_due + interval '0'
           AND j.id = d.id AND j.due_at = d.due_at
           AND j.status = 'dispatched' AND j.attempt = d.attempt
        RETURNING d.i, j.id, d.attempt, j.task,
                  duetime.effective_key(j.id, j.idempotency_key, j.schedule_id,
                                        j.created_by) AS key
    ), ledger AS (
        INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker)
        SELECT s.key, s.id, s.attempt, s.task, worker_name FROM settled s
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING idempotency_key
    )
    SELECT d.i,
           EXISTS (SELECT 1 FROM settled s WHERE s.i = d.i),
           EXISTS (SELECT 1 FROM settled s JOIN ledger l ON l.idempotency_key = s.key
                    WHERE s.i = d.i)
      FROM done d
     ORDER BY d.i;
END $$;

-- finish_attempt (0009) with the result; the same refusals (DT001, DT002).
CREATE FUNCTION duetime.finish_attempt(job_id bigint, job_due_at timestamptz,
                                       job_attempt integer, worker_name text,
                                       job_result jsonb)
    RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    ledger_key text;
    job_task text;
BEGIN
    UPDATE duetime.jobs
       SET status = 'succeeded', finished_at = now(), result = job_result
     WHERE id = job_id AND due_at = job_due_at + interval '0'
       AND status = 'dispatched' AND attempt = job_attempt
    RETURNING duetime.effective_key(id, idempotency_key, schedule_id, created_by), task
         INTO ledger_key, job_task;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'job % attempt % is no longer dispatched', job_id, job_attempt
            USING ERRCODE = 'DT001';
    END IF;
    INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker)
    VALUES (ledger_key, job_id, job_attempt, job_task, worker_name)
    ON CONFLICT (idempotency_key) DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency key of job % is already in the ledger', job_id
            USING ERRCODE = 'DT002';
    END IF;
END $$;

-- Snooze: dispatched(attempt) -> pending at the same attempt, runnable after delay_s
-- (bounded at 366 days like a retry), snoozes + 1. Returns the new count; 0 when the
-- job is at its bound (max_snoozes: nothing changed, the caller fails the attempt);
-- NULL when the row is no longer this attempt's.
CREATE FUNCTION duetime.worker_snooze(job_id bigint, job_due_at timestamptz,
                                      job_attempt integer, delay_s float8)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    used integer;
    allowed integer;
    new_count integer;
BEGIN
    SELECT snoozes, max_snoozes INTO used, allowed
      FROM duetime.jobs
     WHERE id = job_id AND due_at = job_due_at + interval '0'
       AND status = 'dispatched' AND attempt = job_attempt
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF used >= allowed THEN
        RETURN 0;
    END IF;
    UPDATE duetime.jobs
       SET status = 'pending', snoozes = snoozes + 1,
           run_at = greatest(now() + make_interval(secs => least(greatest(delay_s, 0),
                                                                 31622400)), due_at),
           dispatched_at = NULL, heartbeat_at = NULL, dispatch_epoch = NULL
     WHERE id = job_id AND due_at = job_due_at + interval '0'
    RETURNING snoozes INTO new_count;
    RETURN new_count;
END $$;

-- Progress (ctx.progress): fraction and note of a dispatched(attempt) row, in autocommit
-- on the worker's own connection, never in the handler's transaction. 1, or NULL when
-- the row is no longer this attempt's.
CREATE FUNCTION duetime.worker_progress(job_id bigint, job_due_at timestamptz,
                                        job_attempt integer, fraction real, note text)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE duetime.jobs
       SET progress = fraction, progress_note = left(note, 200), progress_at = now()
     WHERE id = job_id AND due_at = job_due_at + interval '0'
       AND status = 'dispatched' AND attempt = job_attempt;
    RETURN CASE WHEN FOUND THEN 1 END;
END $$;

-- Which of these jobs are cancelled: the worker's check of the attempts it runs, when
-- its LISTEN connection was (re)opened and every few seconds while it runs any, so a
-- NOTIFY lost with a connection costs seconds, not the cancel.
CREATE FUNCTION duetime.worker_cancelled(job_ids bigint[])
    RETURNS bigint[]
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(array_agg(id), '{}') FROM duetime.jobs
     WHERE id = ANY(job_ids) AND status = 'cancelled'
$$;

REVOKE EXECUTE ON FUNCTION duetime.notify_job_finished() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.await_job(bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.unawait_job(bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_begin_jobs(bigint[], timestamptz[], integer[],
                                                    bigint[], bigint[], integer[], bigint[])
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_complete(bigint[], timestamptz[], integer[], text,
                                                   jsonb[])
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_finish_group(bigint[], timestamptz[], integer[],
                                                       text, timestamptz, timestamptz,
                                                       jsonb[])
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.finish_attempt(bigint, timestamptz, integer, text, jsonb)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_snooze(bigint, timestamptz, integer, float8)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_cancelled(bigint[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_progress(bigint, timestamptz, integer, real, text)
    FROM PUBLIC;
