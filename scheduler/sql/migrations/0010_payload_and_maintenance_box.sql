-- duetime 0010: the payload ceiling measures the value, not how it is stored; the
-- scheduler's maintenance functions stay inside the maintainer's box (docs/security.md).

-- 1. jobs_payload_too_large / schedules_payload_too_large measured pg_column_size, the
-- size as stored: a value that arrives already compressed (INSERT ... SELECT from a
-- table, after SET default_toast_compression = lz4) measured its compressed size, and
-- a 200 MB payload passed as 784 KB. Now the limit is the uncompressed jsonb size,
-- whatever the path. An uncompressed value (every value a client sends, and every
-- stored value under ~2 KB) is measured as before, in O(1); a compressed one is
-- decompressed to measure it (`|| '{}'` returns the object itself, detoasted: the same
-- bytes, counted uncompressed). That costs a decompression per INSERT or UPDATE of a row
-- whose payload is stored compressed (big payloads only), and nothing otherwise.
-- NOT VALID, as in 0005: new and updated rows are checked, existing ones not scanned.
ALTER TABLE duetime.jobs DROP CONSTRAINT jobs_payload_too_large;
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_payload_too_large
    CHECK (CASE WHEN pg_column_compression(payload) IS NULL THEN pg_column_size(payload)
                ELSE pg_column_size(payload || '{}'::jsonb) END <= 1048576) NOT VALID;
ALTER TABLE duetime.schedules DROP CONSTRAINT schedules_payload_too_large;
ALTER TABLE duetime.schedules ADD CONSTRAINT schedules_payload_too_large
    CHECK (CASE WHEN pg_column_compression(payload) IS NULL THEN pg_column_size(payload)
                ELSE pg_column_size(payload || '{}'::jsonb) END <= 1048576) NOT VALID;

-- 2. The maintainer's box, enforced by the functions the scheduler role may call. Before,
-- the scheduler role could detach today's bucket (all rows terminal is easy at night),
-- DELETE any row of jobs_default (pending jobs due beyond the buckets live there), and
-- ensure_partitions(day, 100000) exhausted the lock table. The maintainer only ever
-- creates buckets from today to today + days_ahead, detaches buckets whose range ended,
-- and deletes terminal rows of DEFAULT past the retention; the functions now allow that
-- and nothing else. ensure_partition(s) stay, for the owner (migrations, tests, repairs).

-- Creates the bucket of `day` (duetime.ensure_partition) when `day` is today (UTC) or up
-- to 100 days ahead (the maintainer's days_ahead is capped to match); refuses any other
-- day with SQLSTATE 22023 (invalid_parameter_value).
CREATE FUNCTION duetime.create_bucket(day date) RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
BEGIN
    IF day IS NULL OR day < today OR day > today + 100 THEN
        RAISE EXCEPTION 'bucket day % is outside today .. today + 100 days (UTC)', day
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN duetime.ensure_partition(day);
END $$;

-- Detach refuses a bucket whose range has not ended (today's or a future day's): a
-- detached bucket's rows leave duetime.jobs, and a new row of that day would land in
-- DEFAULT. The retention itself is the maintainer's setting; this is its floor.
CREATE OR REPLACE FUNCTION duetime.detach_terminal_partition(day date) RETURNS text
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    part text := duetime.partition_name(day);
    rel regclass := to_regclass(format('duetime.%I', part));
BEGIN
    IF day IS NULL OR day >= (now() AT TIME ZONE 'UTC')::date THEN
        RAISE EXCEPTION 'bucket % has not ended: only past days are detached', day
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF rel IS NULL OR NOT EXISTS (
        SELECT 1 FROM pg_catalog.pg_inherits
         WHERE inhrelid = rel AND inhparent = 'duetime.jobs'::regclass) THEN
        RETURN 'missing';
    END IF;
    LOCK TABLE ONLY duetime.jobs IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('LOCK TABLE duetime.%I IN ACCESS EXCLUSIVE MODE', part);
    IF duetime.partition_is_live(rel) THEN
        RETURN 'live';
    END IF;
    EXECUTE format('ALTER TABLE duetime.jobs DETACH PARTITION duetime.%I', part);
    EXECUTE format('ALTER TABLE duetime.%I RENAME TO %I', part, part || '_detached');
    RETURN 'detached';
END $$;

-- One batch of terminal rows in DEFAULT due and finished more than `retention_s`
-- seconds ago (at most `max_rows`, capped at 100000); returns how many went. The outer
-- WHERE repeats the conditions, so a row changed since the inner scan (retried) is not
-- deleted. Pending and dispatched rows are never touched: they are claimed from DEFAULT.
CREATE FUNCTION duetime.prune_default(retention_s float8, max_rows integer) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    horizon timestamptz := now() - make_interval(secs => least(greatest(retention_s, 0),
                                                              1e9));
    gone bigint;
BEGIN
    DELETE FROM duetime.jobs_default
     WHERE ctid = ANY(ARRAY(
               SELECT ctid
                 FROM duetime.jobs_default
                WHERE status IN ('succeeded', 'dead', 'cancelled')
                  AND due_at < horizon
                  AND coalesce(finished_at, due_at) < horizon
                LIMIT least(greatest(max_rows, 0), 100000)))
       AND status IN ('succeeded', 'dead', 'cancelled')
       AND due_at < horizon
       AND coalesce(finished_at, due_at) < horizon;
    GET DIAGNOSTICS gone = ROW_COUNT;
    RETURN gone;
END $$;

REVOKE EXECUTE ON FUNCTION duetime.create_bucket(date) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.prune_default(float8, integer) FROM PUBLIC;
