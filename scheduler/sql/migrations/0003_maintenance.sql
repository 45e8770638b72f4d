-- duetime 0003: what the maintainer duty needs (scheduler/duties/maintainer.py).
-- Daily buckets are created by duetime.ensure_partition (0001); these functions retire
-- them. Every function here takes its strong locks itself, in a fixed order, so the
-- caller only sets lock_timeout / statement_timeout (SET LOCAL) and commits at once.

-- `duetime status` counts recent dead jobs (status.sql dead_by_queue): only dead rows
-- enter this index, so it stays small and costs nothing on the hot paths.
CREATE INDEX jobs_dead_finished_idx ON duetime.jobs (finished_at) WHERE status = 'dead';

-- The day a bucket named by duetime.partition_name holds; NULL for any other name.
CREATE FUNCTION duetime.partition_day(part text) RETURNS date
    LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN part ~ '^jobs_p[0-9]{8}$' THEN to_date(substr(part, 7, 8), 'YYYYMMDD') END
$$;

-- Does the bucket hold a row that is not terminal? Two EXISTS, one per partial index
-- (status = 'pending' / 'dispatched'): each is an index probe on a small index. Written
-- as `status IN (...)` it would read the whole bucket instead.
CREATE FUNCTION duetime.partition_is_live(part regclass) RETURNS boolean
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    live boolean;
BEGIN
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM %1$s WHERE status = ''pending'') '
        '    OR EXISTS (SELECT 1 FROM %1$s WHERE status = ''dispatched'')', part)
        INTO live;
    RETURN live;
END $$;

-- Detach the bucket of `day` if it holds only terminal rows. Returns 'detached',
-- 'live' (a pending/dispatched row is there: kept), or 'missing'.
-- Locks: ACCESS EXCLUSIVE on the parent first (the order DETACH uses itself), then on
-- the bucket; from then on no write can reach the bucket, so the re-check is final
-- (a `jobs retry` may have turned a dead row back into pending since the caller looked).
-- Plain DETACH, not CONCURRENTLY: that cannot run in a transaction and PostgreSQL 15
-- refuses it while a DEFAULT partition exists. The lock is held for a catalog update
-- and two index probes; the caller bounds the wait for it with lock_timeout. The bucket
-- is renamed so that a crash before the DROP leaves an unmistakable leftover
-- (jobs_pYYYYMMDD_detached) for the next pass, never a table an operator made.
CREATE FUNCTION duetime.detach_terminal_partition(day date) RETURNS text
    LANGUAGE plpgsql AS $$
DECLARE
    part text := duetime.partition_name(day);
    rel regclass := to_regclass(format('duetime.%I', part));
BEGIN
    IF rel IS NULL OR NOT EXISTS (
        SELECT 1 FROM pg_inherits
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

-- Drop a bucket detach_terminal_partition detached (by its new name). It is no part of
-- duetime.jobs any more, so this locks nothing a claim or a producer uses.
CREATE FUNCTION duetime.drop_detached_partition(name text) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    rel regclass;
BEGIN
    IF name !~ '^jobs_p[0-9]{8}_detached$' THEN
        RAISE EXCEPTION 'not a detached duetime bucket: %', name;
    END IF;
    rel := to_regclass(format('duetime.%I', name));
    IF rel IS NULL OR EXISTS (SELECT 1 FROM pg_class WHERE oid = rel AND relispartition) THEN
        RETURN false;
    END IF;
    EXECUTE format('DROP TABLE duetime.%I', name);
    RETURN true;
END $$;
