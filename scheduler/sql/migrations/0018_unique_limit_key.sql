-- duetime 0018: unique jobs carry their limit key (0017 added limit_key beside 0014's
-- unique keys).
--
-- duetime.enqueue_unique (JobStore.enqueue with a unique_key) inserts the limit key the
-- caller gave, so a unique job counts against per-key limits and fair shares like any
-- other. A `replace` keeps the holder's limit key: the key names whose work it is (a
-- tenant), which a debounce of the same unique key in the same producer's scope does not
-- change. Plain-SQL producers set `limit_key` in their INSERT.

DROP FUNCTION duetime.enqueue_unique(text, jsonb, timestamptz, text, integer, text, smallint,
                                     text, text, text);

CREATE FUNCTION duetime.enqueue_unique(
        new_task text, new_payload jsonb, new_due_at timestamptz, new_queue text,
        new_max_attempts integer, new_idempotency_key text, new_priority smallint,
        new_limit_key text, new_unique_key text,
        on_conflict text, unique_for text)
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
                                      idempotency_key, priority, limit_key, unique_key)
            VALUES (new_task, new_payload, coalesce(new_due_at, now()), new_queue,
                    new_max_attempts, new_idempotency_key, new_priority, new_limit_key,
                    new_unique_key)
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
                                  idempotency_key, priority, limit_key, unique_key)
        VALUES (new_task, new_payload, coalesce(new_due_at, now()), new_queue,
                new_max_attempts, new_idempotency_key, new_priority, new_limit_key,
                    new_unique_key)
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
