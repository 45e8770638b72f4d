-- duetime 0022: tags and metadata on jobs (DESIGN §12; docs/api.md "Tags and metadata").
--
-- Two producer-settable columns of duetime.jobs, each with a constant default, so adding
-- them rewrites no bucket (the default is kept in the catalog); each CHECK is added
-- NOT VALID (no scan under the ACCESS EXCLUSIVE lock) and validated after, under a
-- SHARE UPDATE EXCLUSIVE lock only (reads and writes go on):
--
--   tags  text[]  what the job is about, to find, cancel and retry jobs by
--                 (`duetime jobs list|cancel|retry --tag T`, JobFilter(tags=...)):
--                 at most 32 tags, each 1-64 characters with no whitespace, comma or
--                 control character, no NULL element, one dimension
--   meta  jsonb   what a producer wants to keep with the job (who asked, a trace of
--                 where it came from): a JSON object of at most 64 KiB, measured as
--                 stored uncompressed like the payload (migration 0010), so the check
--                 costs O(1) on the dispatcher's and workers' updates of the row
--
-- The tag rule is written once, as a regular expression over the tags joined by commas
-- (commas are not allowed inside a tag, so the join is unambiguous): a CHECK cannot run
-- a subquery over the elements. An empty array is tested first and costs nothing more.
--
-- The index: GIN on tags, partial on `cardinality(tags) > 0`, declared on the
-- partitioned parent like every jobs index, so each bucket (present and future) gets
-- its own. Jobs without tags, most of them, add no index entry (a full GIN index holds
-- an "empty item" entry for every such row, paid on every insert and non-HOT update).
-- A tag filter repeats the predicate (jobs.sql `job_filter_tags`) so the planner can use
-- it. Built here under a SHARE lock on each bucket in turn (inserts wait while it builds;
-- every existing row has no tags, so the build reads each bucket once and writes
-- nothing). docs/benchmarks.md "Tag filter" has the measurements at 1M and 10M jobs.

ALTER TABLE duetime.jobs ADD COLUMN tags text[] NOT NULL DEFAULT '{}';
ALTER TABLE duetime.jobs ADD COLUMN meta jsonb NOT NULL DEFAULT '{}'::jsonb;

ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_tags_invalid
    CHECK (cardinality(tags) = 0
           OR (cardinality(tags) <= 32
               AND array_ndims(tags) = 1
               AND array_position(tags, NULL) IS NULL
               AND array_to_string(tags, ',')
                   ~ '^[^\x01-\x20\x7f-\x9f,]{1,64}(,[^\x01-\x20\x7f-\x9f,]{1,64})*$'))
    NOT VALID;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_meta_invalid
    CHECK (jsonb_typeof(meta) = 'object'
           AND CASE WHEN pg_column_compression(meta) IS NULL THEN pg_column_size(meta)
                    ELSE pg_column_size(meta || '{}'::jsonb) END <= 65536)
    NOT VALID;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_tags_invalid;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_meta_invalid;

COMMENT ON COLUMN duetime.jobs.tags IS
    'what the job is about: at most 32 tags of 1-64 characters without whitespace, comma '
    'or control characters; duetime jobs list|cancel|retry --tag';
COMMENT ON COLUMN duetime.jobs.meta IS
    'the producer''s own data kept with the job (a JSON object, at most 64 KiB); '
    'not passed to the handler';

CREATE INDEX jobs_tags_idx ON duetime.jobs USING gin (tags) WHERE cardinality(tags) > 0;

-- enqueue_unique (0017) with the tags and metadata of the new job. A replaced holder
-- (on_conflict 'replace') keeps its own, as it keeps its limit key: the trigger of 0014
-- rewrites only what it runs and when. The 11-argument function stays for producers of
-- the previous release during a rolling deploy.
CREATE FUNCTION duetime.enqueue_unique(
        new_task text, new_payload jsonb, new_due_at timestamptz, new_queue text,
        new_max_attempts integer, new_idempotency_key text, new_priority smallint,
        new_limit_key text, new_unique_key text,
        on_conflict text, unique_for text, new_tags text[], new_meta jsonb)
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
                                      tags, meta)
            VALUES (new_task, new_payload, coalesce(new_due_at, now()), new_queue,
                    new_max_attempts, new_idempotency_key, new_priority, new_limit_key,
                    new_unique_key, coalesce(new_tags, '{}'),
                    coalesce(new_meta, '{}'::jsonb))
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
                                  tags, meta)
        VALUES (new_task, new_payload, coalesce(new_due_at, now()), new_queue,
                new_max_attempts, new_idempotency_key, new_priority, new_limit_key,
                new_unique_key, coalesce(new_tags, '{}'), coalesce(new_meta, '{}'::jsonb))
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
