-- duetime 0029: the same row checks and trigger conditions, cheaper to run
-- (docs/benchmarks.md, "What a one-row statement on jobs pays for its CHECKs and trigger
-- conditions").
--
-- PostgreSQL evaluates every CHECK of a table on every INSERT and every UPDATE of a row,
-- whatever columns changed, and prepares the CHECK expressions again for each statement
-- (they are not cached across statements). A statement that writes one job, such as the
-- finish of an attempt whose handler used ctx.db (one per job, in the job's own
-- transaction), a heartbeat, a retry or a producer's one-row INSERT, paid about 94 us of
-- server time for the 32 CHECKs of duetime.jobs, most of it preparing the expressions.
-- A CHECK that calls one PL/pgSQL function prepares one function call; the function's
-- own expression is prepared once per connection and kept (PL/pgSQL caches it). Measured
-- on PostgreSQL 15: a tags check 7.2 -> ~1.2 us per one-row statement; the finish of an
-- attempt's row (finish_attempt's UPDATE) 0.284 -> 0.251 ms with the twelve CHECKs below,
-- 0.229 ms with the trigger conditions too; a producer's one-row INSERT 0.16 -> 0.11 ms.
--
-- Each constraint keeps its name and its rule (the function returns the expression the
-- constraint held, NULL where it was NULL, so nothing passes or fails that did not
-- before); what a producer's bad row is told, "violates check constraint
-- jobs_tags_invalid", is unchanged. The functions do not set search_path (a SET clause
-- costs more than it saves here); every function and operator in them is qualified with
-- pg_catalog, so a caller's search_path cannot change what they mean. They are plain
-- functions of their arguments (SECURITY INVOKER, executable by everyone, as the
-- built-in functions they call).
--
-- The constraints are added back NOT VALID: re-reading every existing row to prove a rule
-- those rows already passed would hold the table's ACCESS EXCLUSIVE lock (taken by the
-- DROP) for a full scan per constraint. New and updated rows are checked as before.
-- `ALTER TABLE duetime.jobs VALIDATE CONSTRAINT <name>` marks one validated again
-- without blocking writes, for an operator who wants the flag.
--
-- The cheap CHECKs (one comparison, 1-2 us each) stay expressions.

CREATE FUNCTION duetime.check_idempotency_key(idempotency_key text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN idempotency_key IS NULL
        OR (pg_catalog.length(idempotency_key) OPERATOR(pg_catalog.>=) 1
            AND pg_catalog.length(idempotency_key) OPERATOR(pg_catalog.<=) 500);
END $$;

CREATE FUNCTION duetime.check_idempotency_key_reserved(idempotency_key text,
                                                       schedule_id bigint)
    RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN idempotency_key IS NULL
        OR NOT (pg_catalog.starts_with(idempotency_key, 'job:')
                OR pg_catalog.starts_with(idempotency_key, 'key:')
                OR pg_catalog.starts_with(idempotency_key, 'schedule:'))
        OR (schedule_id IS NOT NULL
            AND pg_catalog.starts_with(idempotency_key,
                                       'schedule:' OPERATOR(pg_catalog.||) schedule_id::text
                                           OPERATOR(pg_catalog.||) ':'));
END $$;

CREATE FUNCTION duetime.check_tags(tags text[]) RETURNS boolean
    LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN pg_catalog.cardinality(tags) OPERATOR(pg_catalog.=) 0
        OR (pg_catalog.cardinality(tags) OPERATOR(pg_catalog.<=) 32
            AND pg_catalog.array_ndims(tags) OPERATOR(pg_catalog.=) 1
            AND pg_catalog.array_position(tags, NULL::text) IS NULL
            AND pg_catalog.array_to_string(tags, ',')
                OPERATOR(pg_catalog.~)
                E'^[^\\x01-\\x20\\x7f-\\x9f,]{1,64}(,[^\\x01-\\x20\\x7f-\\x9f,]{1,64})*$');
END $$;

CREATE FUNCTION duetime.check_depends_on(depends_on bigint[]) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN depends_on IS NULL
        OR pg_catalog.array_ndims(depends_on) IS NULL
        OR (pg_catalog.array_ndims(depends_on) OPERATOR(pg_catalog.=) 1
            AND pg_catalog.cardinality(depends_on) OPERATOR(pg_catalog.<=) 100000
            AND pg_catalog.array_position(depends_on, NULL::bigint) IS NULL);
END $$;

CREATE FUNCTION duetime.check_traceparent(traceparent text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN traceparent IS NULL
        OR (traceparent OPERATOR(pg_catalog.~) '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
            AND pg_catalog.substr(traceparent, 4, 32)
                OPERATOR(pg_catalog.<>) '00000000000000000000000000000000'
            AND pg_catalog.substr(traceparent, 37, 16)
                OPERATOR(pg_catalog.<>) '0000000000000000');
END $$;

-- The stored size of a JSON document: as written when PostgreSQL did not compress it,
-- else its uncompressed size (|| '{}' detoasts it), so the bound is on what the producer
-- sent, not on how well it compressed (0010, 0022).
CREATE FUNCTION duetime.check_json_object_size(doc jsonb, max_bytes integer,
                                               must_be_object boolean)
    RETURNS boolean
    LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN (NOT must_be_object
            OR pg_catalog.jsonb_typeof(doc) OPERATOR(pg_catalog.=) 'object')
        AND CASE WHEN pg_catalog.pg_column_compression(doc) IS NULL
                 THEN pg_catalog.pg_column_size(doc)
                 ELSE pg_catalog.pg_column_size(doc OPERATOR(pg_catalog.||) '{}'::jsonb)
            END OPERATOR(pg_catalog.<=) max_bytes;
END $$;

CREATE FUNCTION duetime.check_status(status text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN status OPERATOR(pg_catalog.=)
           ANY ('{pending,dispatched,succeeded,dead,cancelled,waiting}'::text[]);
END $$;

CREATE FUNCTION duetime.check_waiting_has_dependencies(status text, depends_on bigint[])
    RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN status OPERATOR(pg_catalog.<>) 'waiting'
        OR COALESCE(pg_catalog.cardinality(depends_on), 0) OPERATOR(pg_catalog.>) 0;
END $$;

CREATE FUNCTION duetime.check_queue_name(queue text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN queue OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$';
END $$;

CREATE FUNCTION duetime.check_progress(progress real) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN progress IS NULL
        OR (progress::float8 OPERATOR(pg_catalog.>=) 0::float8
            AND progress::float8 OPERATOR(pg_catalog.<=) 1::float8);
END $$;

CREATE FUNCTION duetime.check_timeout_s(timeout_s float8) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN timeout_s IS NULL
        OR (timeout_s OPERATOR(pg_catalog.>) 0::float8
            AND timeout_s OPERATOR(pg_catalog.<=) 604800::float8);
END $$;

ALTER TABLE duetime.jobs
    DROP CONSTRAINT jobs_idempotency_key_invalid,
    ADD CONSTRAINT jobs_idempotency_key_invalid
        CHECK (duetime.check_idempotency_key(idempotency_key)) NOT VALID,
    DROP CONSTRAINT jobs_idempotency_key_reserved,
    ADD CONSTRAINT jobs_idempotency_key_reserved
        CHECK (duetime.check_idempotency_key_reserved(idempotency_key, schedule_id))
        NOT VALID,
    DROP CONSTRAINT jobs_tags_invalid,
    ADD CONSTRAINT jobs_tags_invalid CHECK (duetime.check_tags(tags)) NOT VALID,
    DROP CONSTRAINT jobs_depends_on_invalid,
    ADD CONSTRAINT jobs_depends_on_invalid
        CHECK (duetime.check_depends_on(depends_on)) NOT VALID,
    DROP CONSTRAINT jobs_traceparent_invalid,
    ADD CONSTRAINT jobs_traceparent_invalid
        CHECK (duetime.check_traceparent(traceparent)) NOT VALID,
    DROP CONSTRAINT jobs_meta_invalid,
    ADD CONSTRAINT jobs_meta_invalid
        CHECK (duetime.check_json_object_size(meta, 65536, true)) NOT VALID,
    DROP CONSTRAINT jobs_payload_too_large,
    ADD CONSTRAINT jobs_payload_too_large
        CHECK (duetime.check_json_object_size(payload, 1048576, false)) NOT VALID,
    DROP CONSTRAINT jobs_status_invalid,
    ADD CONSTRAINT jobs_status_invalid CHECK (duetime.check_status(status)) NOT VALID,
    DROP CONSTRAINT jobs_waiting_without_dependencies,
    ADD CONSTRAINT jobs_waiting_without_dependencies
        CHECK (duetime.check_waiting_has_dependencies(status, depends_on)) NOT VALID,
    DROP CONSTRAINT jobs_queue_name_invalid,
    ADD CONSTRAINT jobs_queue_name_invalid CHECK (duetime.check_queue_name(queue)) NOT VALID,
    DROP CONSTRAINT jobs_progress_out_of_range,
    ADD CONSTRAINT jobs_progress_out_of_range
        CHECK (duetime.check_progress(progress)) NOT VALID,
    DROP CONSTRAINT jobs_timeout_s_out_of_range,
    ADD CONSTRAINT jobs_timeout_s_out_of_range
        CHECK (duetime.check_timeout_s(timeout_s)) NOT VALID;

-- The WHEN conditions of the UPDATE triggers are prepared per statement too (about
-- 35 us for the six below on a one-row UPDATE); each becomes one call of a PL/pgSQL
-- function of the values it compared, returning the condition it held. The triggers
-- keep their names (so their firing order), timing, function and, for the fence,
-- DEFERRABLE INITIALLY DEFERRED.

CREATE FUNCTION duetime.when_dispatch_fenced(new_status text, old_status text,
                                             new_epoch bigint, old_epoch bigint,
                                             new_dispatched_at timestamptz,
                                             old_dispatched_at timestamptz)
    RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN new_status OPERATOR(pg_catalog.=) 'dispatched'
       AND (old_status OPERATOR(pg_catalog.<>) 'dispatched'
            OR new_epoch IS DISTINCT FROM old_epoch
            OR new_dispatched_at IS DISTINCT FROM old_dispatched_at);
END $$;

CREATE FUNCTION duetime.when_unique_release(unique_key text, old_status text,
                                            new_status text)
    RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN unique_key IS NOT NULL
       AND old_status OPERATOR(pg_catalog.=) ANY ('{pending,dispatched}'::text[])
       AND new_status OPERATOR(pg_catalog.<>) ALL ('{pending,dispatched}'::text[]);
END $$;

CREATE FUNCTION duetime.when_unique_revive(unique_key text, old_status text,
                                           new_status text)
    RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN unique_key IS NOT NULL
       AND old_status OPERATOR(pg_catalog.<>) ALL ('{pending,dispatched}'::text[])
       AND new_status OPERATOR(pg_catalog.=) ANY ('{pending,dispatched}'::text[]);
END $$;

CREATE FUNCTION duetime.when_unique_key_fixed(old_key text, new_key text, old_queue text,
                                              new_queue text, old_created_by text,
                                              new_created_by text)
    RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN old_key IS DISTINCT FROM new_key
        OR (old_key IS NOT NULL
            AND (old_queue IS DISTINCT FROM new_queue
                 OR old_created_by IS DISTINCT FROM new_created_by));
END $$;

CREATE FUNCTION duetime.when_finished(old_status text, new_status text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN old_status OPERATOR(pg_catalog.=) ANY ('{pending,dispatched,waiting}'::text[])
       AND new_status OPERATOR(pg_catalog.=) ANY ('{succeeded,dead,cancelled}'::text[]);
END $$;

CREATE FUNCTION duetime.when_release_dependents(has_dependents boolean, old_status text,
                                                new_status text)
    RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN (has_dependents OR old_status OPERATOR(pg_catalog.=) 'waiting')
       AND duetime.when_finished(old_status, new_status);
END $$;

DROP TRIGGER jobs_dispatch_fenced ON duetime.jobs;
CREATE CONSTRAINT TRIGGER jobs_dispatch_fenced AFTER UPDATE ON duetime.jobs
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (duetime.when_dispatch_fenced(NEW.status, OLD.status, NEW.dispatch_epoch,
                                       OLD.dispatch_epoch, NEW.dispatched_at,
                                       OLD.dispatched_at))
    EXECUTE FUNCTION duetime.check_dispatch_fence();

DROP TRIGGER jobs_unique_release ON duetime.jobs;
CREATE TRIGGER jobs_unique_release AFTER UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (duetime.when_unique_release(NEW.unique_key, OLD.status, NEW.status))
    EXECUTE FUNCTION duetime.unique_release();

DROP TRIGGER jobs_unique_revive ON duetime.jobs;
CREATE TRIGGER jobs_unique_revive BEFORE UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (duetime.when_unique_revive(NEW.unique_key, OLD.status, NEW.status))
    EXECUTE FUNCTION duetime.unique_revive();

DROP TRIGGER jobs_unique_key_fixed ON duetime.jobs;
CREATE TRIGGER jobs_unique_key_fixed BEFORE UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (duetime.when_unique_key_fixed(OLD.unique_key, NEW.unique_key, OLD.queue,
                                        NEW.queue, OLD.created_by, NEW.created_by))
    EXECUTE FUNCTION duetime.unique_key_fixed();

DROP TRIGGER jobs_release_dependents ON duetime.jobs;
CREATE TRIGGER jobs_release_dependents AFTER UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (duetime.when_release_dependents(NEW.has_dependents, OLD.status, NEW.status))
    EXECUTE FUNCTION duetime.jobs_release_dependents();

DROP TRIGGER jobs_notify_finished ON duetime.jobs;
CREATE TRIGGER jobs_notify_finished AFTER UPDATE ON duetime.jobs
    FOR EACH ROW
    WHEN (duetime.when_finished(OLD.status, NEW.status))
    EXECUTE FUNCTION duetime.notify_job_finished();
