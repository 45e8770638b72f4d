-- finish_attempt: the last statement of an attempt that used ctx.db, sent together with
-- its COMMIT in one round trip (workers/lazydb.py, LazyTransaction.commit). A statement
-- sent that way cannot return a verdict the client reads before the COMMIT runs, so
-- the outcomes that must not commit are errors: the error aborts the transaction and
-- the COMMIT after it does nothing.
--   DT001  the row is no longer this attempt's (finished by another delivery, or a newer
--          attempt exists): the caller rolls back, the delivery is superseded;
--   DT002  the key is already in the ledger (an earlier delivery applied the effect and
--          committed first): the caller rolls back, so the effect is applied once.
-- Same matching as the finish_delivery statement in execution.sql: (id, due_at) is the
-- primary key, `+ interval '0'` keeps the due_at match prunable in a generic plan.
CREATE FUNCTION duetime.finish_attempt(
    job_id bigint, job_due_at timestamptz, job_attempt integer,
    ledger_key text, job_task text, worker_name text
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE duetime.jobs
       SET status = 'succeeded', finished_at = now()
     WHERE id = job_id AND due_at = job_due_at + interval '0'
       AND status = 'dispatched' AND attempt = job_attempt;
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

-- Invoker's rights: it does what the worker role may do anyway (roles.sql grants it).
REVOKE EXECUTE ON FUNCTION duetime.finish_attempt(bigint, timestamptz, integer, text, text, text)
    FROM PUBLIC;
