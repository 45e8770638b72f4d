-- duetime 0005: what least-privilege roles and hostile producers need (docs/security.md).
-- The roles themselves are not created here (they are cluster-wide and optional):
-- `duetime migrate --roles` applies scheduler/sql/roles.sql on top of this schema.

-- 1. Who inserted a row. Producers read their own rows' status through row-level
-- security on this column (roles.sql); they cannot set it (column-level INSERT grants),
-- so it is always the inserting login role. Rows from before this migration keep NULL.
-- Adding a nullable column without a default is a catalog-only change.
ALTER TABLE duetime.jobs ADD COLUMN created_by text;
ALTER TABLE duetime.jobs ALTER COLUMN created_by SET DEFAULT current_user;
ALTER TABLE duetime.schedules ADD COLUMN created_by text;
ALTER TABLE duetime.schedules ALTER COLUMN created_by SET DEFAULT current_user;

-- 2. A ceiling on payloads. Fixed and generous on purpose: a CHECK calling a function
-- that reads a setting would have to be declared IMMUTABLE while it is not (changing the
-- setting would silently leave rows that violate the "constraint"). The configurable,
-- usually much lower, limit belongs in the client API; this is the backstop for plain
-- SQL producers. pg_column_size is O(1) (no detoasting) and measures the value as it is
-- stored. Schedules get the same ceiling so a schedule the database accepted can always
-- become a job (the planner must never fail a batch on one row).
-- NOT VALID: existing rows are not scanned (that would hold ACCESS EXCLUSIVE on every
-- bucket for the whole scan); new and updated rows are checked. An existing row above
-- the limit would refuse its next UPDATE: find them first with
--   SELECT id FROM duetime.jobs WHERE pg_column_size(payload) > 1048576
--      AND status IN ('pending', 'dispatched');
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_payload_too_large
    CHECK (pg_column_size(payload) <= 1048576) NOT VALID;
ALTER TABLE duetime.schedules ADD CONSTRAINT schedules_payload_too_large
    CHECK (pg_column_size(payload) <= 1048576) NOT VALID;

-- 3. Partition DDL without owning the tables. CREATE/ATTACH/DETACH/DROP of a bucket
-- need ownership of duetime.jobs; giving the scheduler role ownership would also give it
-- DROP TABLE, ALTER, TRUNCATE and every row of every table it owns, bypassing the
-- grants and row-level security. Instead the three bucket functions run with their
-- owner's rights (the role that ran the migrations) and do exactly one narrow thing each
-- (arguments are a date, or a name checked against '^jobs_p[0-9]{8}_detached$').
-- Hardened as SECURITY DEFINER functions must be: a fixed search_path (every name in
-- them is schema-qualified), and EXECUTE revoked from PUBLIC (roles.sql grants it to the
-- scheduler role only).
ALTER FUNCTION duetime.ensure_partition(date)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION duetime.ensure_partitions(date, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION duetime.detach_terminal_partition(date)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION duetime.drop_detached_partition(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;

-- partition_is_live reads a bucket directly (privileges of a partition are its own, not
-- its parent's), so it runs as the owner too, and refuses any table that is not a
-- bucket of duetime.jobs: it must not become a "does this table have a pending row"
-- oracle for arbitrary tables.
CREATE OR REPLACE FUNCTION duetime.partition_is_live(part regclass) RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    live boolean;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_inherits
                    WHERE inhrelid = part AND inhparent = 'duetime.jobs'::regclass) THEN
        RAISE EXCEPTION 'not a partition of duetime.jobs: %', part;
    END IF;
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM %1$s WHERE status = ''pending'') '
        '    OR EXISTS (SELECT 1 FROM %1$s WHERE status = ''dispatched'')', part)
        INTO live;
    RETURN live;
END $$;

REVOKE EXECUTE ON FUNCTION duetime.ensure_partition(date) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.ensure_partitions(date, integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.detach_terminal_partition(date) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.drop_detached_partition(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION duetime.partition_is_live(regclass) FROM PUBLIC;
