-- duetime 0023: trace context travels with the job (DESIGN §13 item 4; scheduler/tracing.py).
--
-- `traceparent` text (NULL = none): the W3C Trace Context `traceparent` of the code
-- that enqueued the job, version 00 (`00-<32 hex trace id>-<16 hex parent id>-<2 hex
-- flags>`, 55 characters, lower case, neither id all zeros). Every producer API fills
-- it from the active OpenTelemetry span when the application uses OpenTelemetry; plain
-- SQL producers may set it themselves (the header of the request they serve, say). The
-- worker's span for each attempt is its child, or links to it for a job due later
-- (docs/api.md "Tracing"). A nullable column without a default is a catalog-only
-- change in every bucket; the CHECK is added NOT VALID and validated after, under a
-- SHARE UPDATE EXCLUSIVE lock only (no row holds a value yet).
--
-- The worker reads it with the row it locks at begin (worker_begin_traced, below: the
-- statement of worker_begin_jobs with two more columns), so no message grows and no
-- round trip is added. worker_begin_jobs stays for workers of the previous release
-- during a rolling deploy. enqueue_unique gets an overload with the trace context as a
-- fourteenth argument (after 0022's tags and meta); the eleven- and thirteen-argument
-- ones stay for producers of earlier releases.

ALTER TABLE duetime.jobs ADD COLUMN traceparent text;

ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_traceparent_invalid
    CHECK (traceparent IS NULL
           OR (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
               AND substr(traceparent, 4, 32) <> '00000000000000000000000000000000'
               AND substr(traceparent, 37, 16) <> '0000000000000000')) NOT VALID;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_traceparent_invalid;

COMMENT ON COLUMN duetime.jobs.traceparent IS
    'W3C traceparent (version 00) of the code that enqueued the job; NULL: none';

-- worker_begin_jobs (0019) with the trace context and the time the job was enqueued
-- (created_at: whether it was due at once or later decides child or link).
CREATE FUNCTION duetime.worker_begin_traced(job_ids bigint[], due_ats timestamptz[],
                                            attempts integer[], epochs bigint[],
                                            release_ids bigint[], release_attempts integer[],
                                            release_epochs bigint[])
    RETURNS TABLE (i bigint, status text, attempt integer, max_attempts integer,
                   queue text, task text, payload jsonb, key text, run_time timestamptz,
                   done boolean, epoch bigint, started boolean, timeout_s float8,
                   traceparent text, enqueued_at timestamptz)
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
           j.timeout_s, j.traceparent, j.created_at
      FROM unnest(job_ids, due_ats, attempts, epochs)
               WITH ORDINALITY AS w(id, due_at, attempt, epoch, i)
     CROSS JOIN LATERAL (
            SELECT r.status, r.attempt, r.max_attempts, r.queue, r.task, r.payload,
                   r.dispatch_epoch, r.timeout_s, r.traceparent, r.created_at,
                   duetime.effective_key(r.id, r.idempotency_key, r.schedule_id,
                                         r.created_by) AS effective_key,
                   coalesce(r.run_at, r.due_at) AS run_time
              FROM duetime.jobs r
             WHERE r.id = w.id AND r.due_at = w.due_at
               FOR KEY SHARE
           ) j;
END $$;
REVOKE EXECUTE ON FUNCTION duetime.worker_begin_traced(bigint[], timestamptz[], integer[],
                                                      bigint[], bigint[], integer[], bigint[])
    FROM PUBLIC;

-- enqueue_unique (0022: with tags and meta) with the trace context of the enqueuing code.
CREATE FUNCTION duetime.enqueue_unique(
        new_task text, new_payload jsonb, new_due_at timestamptz, new_queue text,
        new_max_attempts integer, new_idempotency_key text, new_priority smallint,
        new_limit_key text, new_unique_key text,
        on_conflict text, unique_for text, new_tags text[], new_meta jsonb,
        new_traceparent text)
    RETURNS TABLE (outcome text, holder_id bigint, job duetime.jobs)
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    inserted duetime.jobs;
    failed text;
    detail_text text;
BEGIN
    PERFORM set_config('duetime.unique_on_conflict', coalesce(on_conflict, ''), true),
            set_config('duetime.unique_for', coalesce(unique_for, ''), true);
    IF on_conflict = 'error' THEN
        BEGIN
            INSERT INTO duetime.jobs (task, payload, due_at, queue, max_attempts,
                                      idempotency_key, priority, limit_key, unique_key,
                                      tags, meta, traceparent)
            VALUES (new_task, new_payload, coalesce(new_due_at, now()), new_queue,
                    new_max_attempts, new_idempotency_key, new_priority, new_limit_key,
                    new_unique_key, coalesce(new_tags, '{}'),
                    coalesce(new_meta, '{}'::jsonb), new_traceparent)
            RETURNING * INTO inserted;
        EXCEPTION WHEN unique_violation THEN
            GET STACKED DIAGNOSTICS failed = CONSTRAINT_NAME,
                                    detail_text = PG_EXCEPTION_DETAIL;
            IF failed IS DISTINCT FROM 'jobs_unique_key_taken' THEN
                RAISE;
            END IF;
            outcome := 'refused';
            holder_id := substring(detail_text FROM 'held by job ([0-9]+)')::bigint;
        END;
    ELSE
        INSERT INTO duetime.jobs (task, payload, due_at, queue, max_attempts,
                                  idempotency_key, priority, limit_key, unique_key,
                                  tags, meta, traceparent)
        VALUES (new_task, new_payload, coalesce(new_due_at, now()), new_queue,
                new_max_attempts, new_idempotency_key, new_priority, new_limit_key,
                new_unique_key, coalesce(new_tags, '{}'),
                coalesce(new_meta, '{}'::jsonb), new_traceparent)
        RETURNING * INTO inserted;
    END IF;
    IF outcome IS NULL THEN
        outcome := current_setting('duetime.unique_outcome', true);
        holder_id := nullif(current_setting('duetime.unique_holder', true), '')::bigint;
    END IF;
    PERFORM set_config('duetime.unique_on_conflict', '', true),
            set_config('duetime.unique_for', '', true);
    IF inserted.id IS NOT NULL THEN
        job := inserted;
    ELSIF outcome <> 'refused' THEN
        -- by its primary key: one bucket (the id alone would probe every bucket's index)
        SELECT j.* INTO job FROM duetime.jobs j
         WHERE j.id = holder_id
           AND j.due_at = nullif(current_setting('duetime.unique_holder_due_at', true),
                                 '')::timestamptz;
    END IF;
    RETURN NEXT;
END $$;
