-- duetime 0014: unique jobs and debounce (DESIGN §11; docs/api.md "Unique jobs",
-- docs/security.md "Unique keys are scoped by producer").
--
-- Contract: a job with a unique_key holds that key in its queue while it is live
-- (pending or dispatched). At most one live job per (queue, created_by, unique_key),
-- for every producer including plain SQL, under concurrency. A duplicate INSERT does not
-- fail: the row is skipped (INSERT ... RETURNING returns no row for it) and the id of the
-- job holding the key is left in the transaction-local setting duetime.unique_holder
-- (its due_at in duetime.unique_holder_due_at, for a lookup by primary key).
--
-- Why a side table and not a unique index: duetime.jobs is partitioned by due_at, and a
-- unique index on a partitioned table must contain the partition key, so it cannot say
-- "one per key across all days". duetime.unique_keys has one row per key held; its
-- primary key is what serialises concurrent producers (INSERT ... ON CONFLICT waits for
-- the other inserter's transaction, then sees its row).
--
-- Why producers do not see a constraint error: a unique violation aborts the
-- producer's whole business transaction, which is what a plain-SQL outbox insert must
-- never risk. The policy is chosen per transaction with settings the BEFORE INSERT
-- trigger reads (SET LOCAL or set_config(..., true); JobStore sets them itself):
--   duetime.unique_on_conflict  'skip' (default) | 'replace' (debounce) | 'error'
--   duetime.unique_for          an interval: the key stays taken that long after the
--                               enqueue, even once the job finished (default: none)
--
-- Why scope by created_by (as migration 0007 does for idempotency keys): a key shared
-- by every producer would let one producer block another's jobs by inserting its keys
-- first, and learn through the skip that another producer holds a key. created_by is
-- current_user at insert time and not producer-settable (0005), so two producers' keys
-- never meet; producers meant to share a key space log in as, or SET ROLE to, the same
-- role.
--
-- When a key is released: the terminal transition of its job (succeeded, dead,
-- cancelled) deletes the key row (AFTER UPDATE trigger), or marks it released when a
-- unique_for window is still running; a released row whose window ended is deleted by
-- later claims, two at a time. Rows can only leave duetime.jobs once terminal
-- (retention detaches buckets with no live row, prune_default deletes terminal rows),
-- so those never hold a key. A live job removed by hand (DELETE or TRUNCATE by the
-- owner; neither fires the release) leaves a stale key row: the next claim of that key
-- finds its job gone and takes the key over, so staleness never blocks anyone.
--
-- Cost when unique_key is NULL: each trigger has a WHEN clause on unique_key, so no
-- function runs; measured in docs/benchmarks.md ("Unique jobs").

-- A nullable column without a default: a catalog-only change in every bucket.
ALTER TABLE duetime.jobs ADD COLUMN unique_key text;

-- 1-200 characters, no control characters (they make keys unreadable in logs and in the
-- CLI, and invite look-alike keys). NOT VALID as in 0005: every existing row is NULL, and
-- validating would scan every bucket under ACCESS EXCLUSIVE. New buckets copy it
-- (ensure_partition: LIKE ... INCLUDING CONSTRAINTS).
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_unique_key_invalid
    CHECK (unique_key IS NULL OR unique_key ~ '^[^[:cntrl:]]{1,200}$') NOT VALID;

CREATE TABLE duetime.unique_keys (
    queue       text        NOT NULL,
    -- created_by of the holder ('' for rows from before 0005, which have none)
    scope       text        NOT NULL,
    unique_key  text        NOT NULL,
    job_id      bigint      NOT NULL,
    job_due_at  timestamptz NOT NULL,
    -- end of the unique_for window; NULL: held only while the job is live
    held_until  timestamptz,
    -- the job reached a terminal state; the row stays only for held_until
    released    boolean     NOT NULL DEFAULT false,
    CONSTRAINT unique_keys_pkey PRIMARY KEY (queue, scope, unique_key)
);
CREATE INDEX unique_keys_expiry_idx ON duetime.unique_keys (held_until) WHERE released;
ALTER TABLE duetime.unique_keys SET (autovacuum_vacuum_scale_factor = 0.02);

COMMENT ON TABLE duetime.unique_keys IS
    'unique keys held by live jobs or unique_for windows (migration 0014); written only by '
    'the triggers on duetime.jobs';

-- Is the key row `k` still holding its key? Its job is live, or its window runs. The job
-- is looked up by its primary key (id, due_at): one bucket, one index probe. A job that
-- is gone (deleted by hand) holds nothing.
CREATE FUNCTION duetime.unique_key_held(k duetime.unique_keys) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF k.held_until > now() THEN
        RETURN true;
    END IF;
    RETURN EXISTS (SELECT 1 FROM duetime.jobs
                    WHERE id = k.job_id AND due_at = k.job_due_at
                      AND status IN ('pending', 'dispatched'));
END $$;

-- BEFORE INSERT: claim the key, or apply the transaction's policy to the duplicate.
CREATE FUNCTION duetime.unique_claim() RETURNS trigger
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
                   run_at = NEW.due_at
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

-- AFTER UPDATE to a terminal state: release the key, or keep it for its window.
CREATE FUNCTION duetime.unique_release() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM duetime.unique_keys
     WHERE queue = NEW.queue AND scope = coalesce(NEW.created_by, '')
       AND unique_key = NEW.unique_key AND job_id = NEW.id
       AND (held_until IS NULL OR held_until <= now());
    IF NOT FOUND THEN
        UPDATE duetime.unique_keys SET released = true
         WHERE queue = NEW.queue AND scope = coalesce(NEW.created_by, '')
           AND unique_key = NEW.unique_key AND job_id = NEW.id;
    END IF;
    RETURN NULL;
END $$;

-- BEFORE UPDATE from a terminal state back to a live one (`jobs retry` of a dead job):
-- the job must hold its key again. When another live job (or another job's window)
-- holds it, the update of this row is skipped and the job stays as it was, so a bulk
-- retry goes on with the other rows; JobStore.retry says why.
CREATE FUNCTION duetime.unique_revive() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    owner_scope text := coalesce(NEW.created_by, '');
    k duetime.unique_keys;
BEGIN
    LOOP
        INSERT INTO duetime.unique_keys (queue, scope, unique_key, job_id, job_due_at)
        VALUES (NEW.queue, owner_scope, NEW.unique_key, NEW.id, NEW.due_at)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN NEW;
        END IF;
        SELECT * INTO k FROM duetime.unique_keys
         WHERE queue = NEW.queue AND scope = owner_scope AND unique_key = NEW.unique_key
           FOR UPDATE;
        EXIT WHEN FOUND;
    END LOOP;
    IF k.job_id = NEW.id OR NOT duetime.unique_key_held(k) THEN
        UPDATE duetime.unique_keys
           SET job_id = NEW.id, job_due_at = NEW.due_at, released = false,
               held_until = CASE WHEN k.job_id = NEW.id THEN k.held_until END
         WHERE queue = k.queue AND scope = k.scope AND unique_key = k.unique_key;
        RETURN NEW;
    END IF;
    RETURN NULL;
END $$;

-- What identifies a key never changes on a row that has one (only the owner could try).
CREATE FUNCTION duetime.unique_key_fixed() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'unique_key, queue and created_by of job % cannot change', OLD.id
        USING ERRCODE = 'check_violation', CONSTRAINT = 'jobs_unique_key_fixed';
END $$;

-- JobStore.enqueue of a job with a unique key, in one round trip and without a
-- transaction of its own: sets the policy, inserts, reads the trigger's verdict, clears
-- the policy, and returns what happened with the job that holds the key afterwards
-- (NULL when that job is no longer stored: a finished holder removed by retention while
-- its window runs). SECURITY INVOKER: the caller's privileges and row-level security
-- apply, so a producer reads only its own holder. Under 'error' the refusal is caught
-- in a block of its own (a subtransaction) and returned as outcome 'refused', so it
-- does not abort the caller's transaction; the other policies never raise for a held
-- key and take no subtransaction.
CREATE FUNCTION duetime.enqueue_unique(
        new_task text, new_payload jsonb, new_due_at timestamptz, new_queue text,
        new_max_attempts integer, new_idempotency_key text, new_unique_key text,
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
                                      idempotency_key, unique_key)
            VALUES (new_task, new_payload, coalesce(new_due_at, now()), new_queue,
                    new_max_attempts, new_idempotency_key, new_unique_key)
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
                                  idempotency_key, unique_key)
        VALUES (new_task, new_payload, coalesce(new_due_at, now()), new_queue,
                new_max_attempts, new_idempotency_key, new_unique_key)
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

REVOKE EXECUTE ON FUNCTION duetime.unique_key_held(duetime.unique_keys) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.unique_claim() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.unique_release() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.unique_revive() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.unique_key_fixed() FROM PUBLIC;

-- Triggers on the partitioned table are cloned into every bucket, and into each new
-- bucket when ensure_partition attaches it. Rows ensure_partition moves out of DEFAULT
-- are deleted and inserted on the buckets directly, before the new bucket is attached,
-- so no claim or release runs for them and their key rows (which name id and due_at,
-- both unchanged) stay right.
CREATE TRIGGER jobs_unique_claim BEFORE INSERT ON duetime.jobs
    FOR EACH ROW WHEN (NEW.unique_key IS NOT NULL)
    EXECUTE FUNCTION duetime.unique_claim();
CREATE TRIGGER jobs_unique_release AFTER UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (NEW.unique_key IS NOT NULL AND OLD.status IN ('pending', 'dispatched')
          AND NEW.status NOT IN ('pending', 'dispatched'))
    EXECUTE FUNCTION duetime.unique_release();
CREATE TRIGGER jobs_unique_revive BEFORE UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (NEW.unique_key IS NOT NULL AND OLD.status NOT IN ('pending', 'dispatched')
          AND NEW.status IN ('pending', 'dispatched'))
    EXECUTE FUNCTION duetime.unique_revive();
CREATE TRIGGER jobs_unique_key_fixed BEFORE UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (OLD.unique_key IS DISTINCT FROM NEW.unique_key
          OR (OLD.unique_key IS NOT NULL
              AND (OLD.queue IS DISTINCT FROM NEW.queue
                   OR OLD.created_by IS DISTINCT FROM NEW.created_by)))
    EXECUTE FUNCTION duetime.unique_key_fixed();
