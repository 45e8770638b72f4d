-- duetime 0017: unique jobs carry their priority (0015) and limit key (0016), which were
-- added beside 0014's unique keys.
--
-- duetime.enqueue_unique (JobStore.enqueue with a unique_key) inserts the priority and
-- limit key the caller gave. A `replace` (debounce) gives the pending holder the new
-- job's priority along with its task, payload and run time: the replacing job is what
-- should run, at the urgency it was enqueued with. It keeps the holder's limit key: that
-- key names whose work it is (a tenant), which a debounce of the same unique key in the
-- same producer's scope does not change. Plain-SQL producers set both columns in their
-- INSERT; the claim trigger reads NEW like every other column.

CREATE OR REPLACE FUNCTION duetime.unique_claim() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    policy text := coalesce(nullif(current_setting('duetime.unique_on_conflict', true), ''),
                            'skip');
    hold text := nullif(current_setting('duetime.unique_for', true), '');
    owner_scope text := coalesce(NEW.created_by, '');
    until timestamptz;
    k duetime.unique_keys;
    holder_due timestamptz;
BEGIN
    IF NEW.status NOT IN ('pending', 'dispatched') THEN
        RETURN NEW;  -- a finished row (an import of history) holds nothing
    END IF;
    IF policy NOT IN ('skip', 'replace', 'error') THEN
        RAISE EXCEPTION 'duetime.unique_on_conflict is %; expected skip, replace or error',
                        policy USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF hold IS NOT NULL THEN
        IF hold::interval < interval '0' OR hold::interval > interval '366 days' THEN
            RAISE EXCEPTION 'duetime.unique_for is %; expected 0 to 366 days', hold
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        until := NEW.created_at + hold::interval;
    END IF;
    PERFORM set_config('duetime.unique_holder', '', true),
            set_config('duetime.unique_holder_due_at', '', true),
            set_config('duetime.unique_outcome', 'inserted', true);
    LOOP
        INSERT INTO duetime.unique_keys (queue, scope, unique_key, job_id, job_due_at,
                                         held_until)
        VALUES (NEW.queue, owner_scope, NEW.unique_key, NEW.id, NEW.due_at, until)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            -- Keep the table to what is held: two released rows whose window ended.
            DELETE FROM duetime.unique_keys
             WHERE ctid = ANY(ARRAY(SELECT ctid FROM duetime.unique_keys
                                     WHERE released AND held_until < now()
                                     LIMIT 2 FOR UPDATE SKIP LOCKED))
               AND released AND held_until < now();
            RETURN NEW;
        END IF;
        SELECT * INTO k FROM duetime.unique_keys
         WHERE queue = NEW.queue AND scope = owner_scope AND unique_key = NEW.unique_key
           FOR UPDATE;
        IF FOUND THEN
            EXIT;
        END IF;
        -- released between our INSERT and the lock: claim again
    END LOOP;

    IF NOT duetime.unique_key_held(k) THEN
        -- the window ended, or the job is gone or finished without the release running
        UPDATE duetime.unique_keys
           SET job_id = NEW.id, job_due_at = NEW.due_at, held_until = until, released = false
         WHERE queue = k.queue AND scope = k.scope AND unique_key = k.unique_key;
        RETURN NEW;
    END IF;

    IF policy = 'error' THEN
        RAISE EXCEPTION 'unique key % of queue % is held by job %', NEW.unique_key,
                        NEW.queue, k.job_id
            USING ERRCODE = 'unique_violation', CONSTRAINT = 'jobs_unique_key_taken',
                  DETAIL = format('held by job %s', k.job_id);
    END IF;

    IF policy = 'replace' AND NOT k.released THEN
        -- Debounce: the pending holder takes the new task, payload and run time. A
        -- dispatched holder has started with the old payload and is left alone: the new
        -- row is skipped (docs/api.md). SKIP LOCKED: a holder locked at this instant is
        -- being dispatched or changed, and counts as dispatched; waiting for it while
        -- holding the key row could deadlock with its release, which locks the job row
        -- first and the key row second.
        SELECT due_at INTO holder_due FROM duetime.jobs
         WHERE id = k.job_id AND due_at = k.job_due_at AND status = 'pending'
           FOR UPDATE SKIP LOCKED;
        IF holder_due IS NOT NULL AND holder_due <= NEW.due_at THEN
            UPDATE duetime.jobs
               SET task = NEW.task, payload = NEW.payload, max_attempts = NEW.max_attempts,
                   priority = NEW.priority, run_at = NEW.due_at
             WHERE id = k.job_id AND due_at = k.job_due_at;
            PERFORM set_config('duetime.unique_holder', k.job_id::text, true),
                    set_config('duetime.unique_holder_due_at', k.job_due_at::text, true),
                    set_config('duetime.unique_outcome', 'replaced', true);
            IF until > coalesce(k.held_until, '-infinity') THEN
                UPDATE duetime.unique_keys SET held_until = until
                 WHERE queue = k.queue AND scope = k.scope AND unique_key = k.unique_key;
            END IF;
            RETURN NULL;
        ELSIF holder_due IS NOT NULL THEN
            -- A run time before the holder's due_at cannot be written into it (due_at is
            -- the partition key, run_at >= due_at): the holder is cancelled and the new
            -- row takes the key. The release trigger runs for the holder first.
            UPDATE duetime.jobs
               SET status = 'cancelled', finished_at = now(),
                   last_error = format('replaced by a job due earlier with unique key %s',
                                       left(NEW.unique_key, 100))
             WHERE id = k.job_id AND due_at = k.job_due_at;
            INSERT INTO duetime.unique_keys (queue, scope, unique_key, job_id,
                                             job_due_at, held_until)
            VALUES (NEW.queue, owner_scope, NEW.unique_key, NEW.id, NEW.due_at,
                    greatest(until, k.held_until))
            ON CONFLICT (queue, scope, unique_key) DO UPDATE
               SET job_id = EXCLUDED.job_id, job_due_at = EXCLUDED.job_due_at,
                   held_until = EXCLUDED.held_until, released = false;
            PERFORM set_config('duetime.unique_outcome', 'replaced', true);
            RETURN NEW;
        END IF;
    END IF;
    PERFORM set_config('duetime.unique_holder', k.job_id::text, true),
            set_config('duetime.unique_holder_due_at', k.job_due_at::text, true),
            set_config('duetime.unique_outcome', 'skipped', true);
    RETURN NULL;
END $$;

DROP FUNCTION duetime.enqueue_unique(text, jsonb, timestamptz, text, integer, text, text,
                                     text, text);

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
