-- duetime 0024: an outcome that frees a slot of a concurrency limit wakes the dispatcher
-- (docs/architecture.md, "Limits"; docs/benchmarks.md, "Flow control: the slot wake-up").
--
-- A job under a `max_running` limit holds its slot from dispatch until its outcome
-- commits. The dispatcher learnt that a slot was free only at its next re-count
-- (`limits_poll`, 50 ms): with 200 ms jobs under `--max-running 3` that poll, plus the
-- claim and the broker after it, cost a third of the limit's throughput (0.60-0.64x of
-- the ideal, measured). Now each settling function the worker calls NOTIFYs
-- `duetime_jobs` (the channel the dispatcher LISTENs on for new jobs) when a row it
-- settled falls under a limit with `max_running`, in the settling transaction itself:
-- no extra round trip, delivered only if the outcome commits, and at most one per
-- transaction (PostgreSQL folds equal notifications of one transaction).
--
-- Unlimited jobs pay one probe of the (small) limits table per statement and no NOTIFY:
-- a NOTIFY serialises commits on PostgreSQL's notify queue lock (migration 0004), so it
-- is sent only for a job that holds a slot. Rate limits need no wake-up (an outcome frees
-- no start; the dispatcher knows when its window frees one), nor fair-only queues.
--
-- CREATE OR REPLACE keeps owners and grants (roles.sql). The bodies are those of
-- migrations 0009 (worker_retry, worker_dead) and 0019 (the others) plus the wake-up.
-- The previous release's overloads (0009, without results) are left as they were: a
-- worker of that release during a rolling deploy settles without waking, and the
-- dispatcher's re-count finds the slot as before.

CREATE OR REPLACE FUNCTION duetime.worker_complete(job_ids bigint[], due_ats timestamptz[],
                                                   attempts integer[], worker_name text,
                                                   results jsonb[])
    RETURNS bigint[]
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    settled_ids bigint[];
    frees_slot boolean;
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
        RETURNING j.id, d.attempt, j.task, j.queue,
                  duetime.effective_key(j.id, j.idempotency_key, j.schedule_id,
                                        j.created_by) AS key
    ), ledger AS (
        INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task, worker)
        SELECT s.key, s.id, s.attempt, s.task, worker_name FROM settled s
        ON CONFLICT (idempotency_key) DO NOTHING
    )
    SELECT coalesce(array_agg(s.id), '{}'),
           EXISTS (SELECT 1 FROM settled x JOIN duetime.limits l
                       ON l.target IN ('task:' || x.task, 'queue:' || x.queue)
                    WHERE l.max_running IS NOT NULL)
      INTO settled_ids, frees_slot
      FROM settled s;
    IF frees_slot THEN
        PERFORM pg_notify('duetime_jobs', 'slot');
    END IF;
    RETURN settled_ids;
END $$;

CREATE OR REPLACE FUNCTION duetime.worker_finish_group(job_ids bigint[], due_ats timestamptz[],
                                                       attempts integer[], worker_name text,
                                                       first_due timestamptz,
                                                       last_due timestamptz,
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
    -- the group's rows again, only while some limit has max_running (a job of the group
    -- that this statement did not settle only makes the wake-up a spare one)
    IF EXISTS (SELECT 1 FROM duetime.limits WHERE max_running IS NOT NULL) THEN
        IF EXISTS (SELECT 1 FROM duetime.jobs j JOIN duetime.limits l
                       ON l.target IN ('task:' || j.task, 'queue:' || j.queue)
                    WHERE l.max_running IS NOT NULL
                      AND j.id = ANY(job_ids)
                      AND j.due_at >= first_due + interval '0'
                      AND j.due_at <= last_due + interval '0') THEN
            PERFORM pg_notify('duetime_jobs', 'slot');
        END IF;
    END IF;
END $$;

CREATE OR REPLACE FUNCTION duetime.finish_attempt(job_id bigint, job_due_at timestamptz,
                                                  job_attempt integer, worker_name text,
                                                  job_result jsonb)
    RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    ledger_key text;
    job_task text;
    job_queue text;
BEGIN
    UPDATE duetime.jobs
       SET status = 'succeeded', finished_at = now(), result = job_result
     WHERE id = job_id AND due_at = job_due_at + interval '0'
       AND status = 'dispatched' AND attempt = job_attempt
    RETURNING duetime.effective_key(id, idempotency_key, schedule_id, created_by), task, queue
         INTO ledger_key, job_task, job_queue;
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
    IF EXISTS (SELECT 1 FROM duetime.limits
                WHERE target IN ('task:' || job_task, 'queue:' || job_queue)
                  AND max_running IS NOT NULL) THEN
        PERFORM pg_notify('duetime_jobs', 'slot');
    END IF;
END $$;

CREATE OR REPLACE FUNCTION duetime.worker_retry(job_id bigint, job_due_at timestamptz,
                                                job_attempt integer, delay_s float8,
                                                error text, budgets text)
    RETURNS timestamptz
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    next_run timestamptz;
    job_task text;
    job_queue text;
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
    RETURNING run_at, task, queue INTO next_run, job_task, job_queue;
    IF FOUND AND EXISTS (SELECT 1 FROM duetime.limits
                          WHERE target IN ('task:' || job_task, 'queue:' || job_queue)
                            AND max_running IS NOT NULL) THEN
        PERFORM pg_notify('duetime_jobs', 'slot');
    END IF;
    RETURN next_run;
END $$;

CREATE OR REPLACE FUNCTION duetime.worker_dead(job_id bigint, job_due_at timestamptz,
                                               job_attempt integer, error text, budgets text)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    job_task text;
    job_queue text;
BEGIN
    UPDATE duetime.jobs
       SET status = 'dead', finished_at = now(), last_error = error, heartbeat_at = NULL,
           max_attempts = coalesce((budgets::jsonb ->> task)::int, max_attempts)
     WHERE id = job_id AND due_at = job_due_at + interval '0'
       AND status = 'dispatched' AND attempt = job_attempt
    RETURNING task, queue INTO job_task, job_queue;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM duetime.limits
                WHERE target IN ('task:' || job_task, 'queue:' || job_queue)
                  AND max_running IS NOT NULL) THEN
        PERFORM pg_notify('duetime_jobs', 'slot');
    END IF;
    RETURN 1;
END $$;

CREATE OR REPLACE FUNCTION duetime.worker_snooze(job_id bigint, job_due_at timestamptz,
                                                 job_attempt integer, delay_s float8)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    used integer;
    allowed integer;
    new_count integer;
    job_task text;
    job_queue text;
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
    RETURNING snoozes, task, queue INTO new_count, job_task, job_queue;
    IF EXISTS (SELECT 1 FROM duetime.limits
                WHERE target IN ('task:' || job_task, 'queue:' || job_queue)
                  AND max_running IS NOT NULL) THEN
        PERFORM pg_notify('duetime_jobs', 'slot');
    END IF;
    RETURN new_count;
END $$;
