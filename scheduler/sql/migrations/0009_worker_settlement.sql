-- duetime 0009: the worker settles only the attempt it holds (docs/security.md, "The
-- worker settles only dispatched attempts").
--
-- Handlers run ctx.db as the worker's login, so whatever the worker role may do, a
-- handler may do. With UPDATE on duetime.jobs and INSERT on duetime.job_ledger that was
-- "rewrite any job": mark every pending job succeeded or cancelled, push run_at to 9999,
-- plant ledger keys for jobs not yet inserted. Now the worker role holds no table
-- privilege on either table (roles.sql): every worker statement is one of the
-- SECURITY DEFINER functions below, and each allows exactly one transition of a row
-- that is `dispatched` at the attempt the caller names:
--
--   worker_begin         read (and FOR KEY SHARE) the rows of a batch of deliveries
--   worker_complete      dispatched(attempt) -> succeeded, + its ledger row (batched)
--   worker_finish_group  the same inside a handler's transaction group
--   finish_attempt       the same for one attempt, inside the handler's transaction
--   worker_retry         dispatched(attempt) -> pending(attempt + 1), run_at <= now + 366 d
--   worker_dead          dispatched(attempt) -> dead
--   worker_heartbeat     heartbeat_at = now() of a dispatched(attempt) row
--
-- The ledger row is derived from the job row being settled (its key is
-- duetime.effective_key() of that row, its task the row's task), never taken from the
-- caller: a ledger row exists only for a job that was dispatched and is settled in the
-- same statement. Each function has a fixed search_path and schema-qualified names;
-- EXECUTE is revoked from PUBLIC (roles.sql grants it to the worker role).
--
-- Statement shapes are the ones execution.sql had (see its header): (id, due_at) is the
-- primary key, `+ interval '0'` keeps due_at matches prunable in generic plans, and
-- PL/pgSQL caches each statement's plan per connection like a prepared statement.

CREATE FUNCTION duetime.worker_begin(job_ids bigint[], due_ats timestamptz[])
    RETURNS TABLE (i bigint, status text, attempt integer, max_attempts integer,
                   queue text, task text, payload jsonb, key text, run_time timestamptz,
                   done boolean, epoch bigint)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT w.i, j.status, j.attempt, j.max_attempts, j.queue, j.task, j.payload,
           j.effective_key, j.run_time,
           EXISTS (SELECT 1 FROM duetime.job_ledger l
                    WHERE l.idempotency_key = j.effective_key),
           j.dispatch_epoch
      FROM unnest(job_ids, due_ats) WITH ORDINALITY AS w(id, due_at, i)
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

CREATE FUNCTION duetime.worker_complete(job_ids bigint[], due_ats timestamptz[],
                                        attempts integer[], worker_name text)
    RETURNS bigint[]
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    settled_ids bigint[];
BEGIN
    WITH done AS (
        SELECT * FROM unnest(job_ids, due_ats, attempts) AS d(id, due_at, attempt)
    ), settled AS (
        UPDATE duetime.jobs j
           SET status = 'succeeded', finished_at = now()
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

CREATE FUNCTION duetime.worker_finish_group(job_ids bigint[], due_ats timestamptz[],
                                            attempts integer[], worker_name text,
                                            first_due timestamptz, last_due timestamptz)
    RETURNS TABLE (i bigint, settled boolean, recorded boolean)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH done AS (
        SELECT * FROM unnest(job_ids, due_ats, attempts)
            WITH ORDINALITY AS d(id, due_at, attempt, i)
    ), settled AS (
        UPDATE duetime.jobs j
           SET status = 'succeeded', finished_at = now()
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

-- finish_attempt is sent with its COMMIT in one round trip (workers/lazydb.py,
-- LazyTransaction.commit): a statement sent that way cannot return a verdict the client
-- reads before the COMMIT runs, so the outcomes that must not commit are errors, which
-- abort the transaction so that the COMMIT after them does nothing:
--   DT001  the row is no longer this attempt's (finished by another delivery, or a newer
--          attempt exists): the caller rolls back, the delivery is superseded;
--   DT002  the key is already in the ledger (an earlier delivery applied the effect and
--          committed first): the caller rolls back, so the effect is applied once.
CREATE FUNCTION duetime.finish_attempt(job_id bigint, job_due_at timestamptz,
                                       job_attempt integer, worker_name text)
    RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    ledger_key text;
    job_task text;
BEGIN
    UPDATE duetime.jobs
       SET status = 'succeeded', finished_at = now()
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

-- budgets: task -> max_attempts of the tasks the worker registered with one (the budget
-- that applied is recorded; the table's CHECK keeps it in 1..1000). The delay is bounded
-- here again (366 days), so no caller can push a run time further.
CREATE FUNCTION duetime.worker_retry(job_id bigint, job_due_at timestamptz,
                                     job_attempt integer, delay_s float8, error text,
                                     budgets text)
    RETURNS timestamptz
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    next_run timestamptz;
BEGIN
    UPDATE duetime.jobs
       SET status = 'pending', attempt = attempt + 1,
           run_at = greatest(now() + make_interval(secs => least(greatest(delay_s, 0),
                                                                 31622400)), due_at),
           last_error = error, dispatched_at = NULL, heartbeat_at = NULL,
           dispatch_epoch = NULL,
           max_attempts = coalesce((budgets::jsonb ->> task)::int, max_attempts)
     WHERE id = job_id AND due_at = job_due_at + interval '0'
       AND status = 'dispatched' AND attempt = job_attempt
    RETURNING run_at INTO next_run;
    RETURN next_run;
END $$;

CREATE FUNCTION duetime.worker_dead(job_id bigint, job_due_at timestamptz,
                                    job_attempt integer, error text, budgets text)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE duetime.jobs
       SET status = 'dead', finished_at = now(), last_error = error, heartbeat_at = NULL,
           max_attempts = coalesce((budgets::jsonb ->> task)::int, max_attempts)
     WHERE id = job_id AND due_at = job_due_at + interval '0'
       AND status = 'dispatched' AND attempt = job_attempt;
    RETURN CASE WHEN FOUND THEN 1 END;
END $$;

CREATE FUNCTION duetime.worker_heartbeat(job_id bigint, job_due_at timestamptz,
                                         job_attempt integer)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE duetime.jobs
       SET heartbeat_at = now()
     WHERE id = job_id AND due_at = job_due_at + interval '0'
       AND status = 'dispatched' AND attempt = job_attempt;
    RETURN CASE WHEN FOUND THEN 1 END;
END $$;

REVOKE EXECUTE ON FUNCTION duetime.worker_begin(bigint[], timestamptz[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_complete(bigint[], timestamptz[], integer[], text)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_finish_group(bigint[], timestamptz[], integer[],
                                                       text, timestamptz, timestamptz)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.finish_attempt(bigint, timestamptz, integer, text)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_retry(bigint, timestamptz, integer, float8, text,
                                                text)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_dead(bigint, timestamptz, integer, text, text)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.worker_heartbeat(bigint, timestamptz, integer)
    FROM PUBLIC;
