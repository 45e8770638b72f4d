-- duetime 0013: the scheduler role prunes the idempotency ledger only through a function
-- that keeps the ledger's window (docs/security.md "The maintainer's box").
--
-- The ledger is the idempotency window: a job whose key has a ledger row is settled as a
-- duplicate without running. The scheduler role pruned it with a DELETE of its own (and
-- UPDATE on completed_at, for FOR UPDATE), so any scheduler login, or a retention of 0,
-- could empty it: every pending duplicate of a completed key would then run again, and a
-- ledger row of a job still pending or dispatched would be gone before its job settled.
-- Now the role holds SELECT only (roles.sql), and duetime.prune_ledger deletes, at most
-- 100,000 per call, rows completed more than `retention_s` ago, refuses a retention
-- under one day (SQLSTATE 22023; the maintainer's setting has the same floor,
-- retention_days >= 1), and never deletes the row of a job that is pending or
-- dispatched (one probe of jobs_id_idx per row, inside a maintenance batch).

CREATE FUNCTION duetime.prune_ledger(retention_s float8, max_rows integer) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    horizon timestamptz;
    gone bigint;
BEGIN
    IF retention_s IS NULL OR retention_s = 'NaN'::float8 OR retention_s < 86400 THEN
        RAISE EXCEPTION 'ledger retention % s is under the floor of 86400 s (one day)',
            retention_s USING ERRCODE = 'invalid_parameter_value';
    END IF;
    horizon := now() - make_interval(secs => least(retention_s, 1e9));
    WITH doomed AS (
        SELECT l.idempotency_key
          FROM duetime.job_ledger l
         WHERE l.completed_at < horizon
           AND NOT EXISTS (SELECT 1 FROM duetime.jobs j
                            WHERE j.id = l.job_id AND j.status IN ('pending', 'dispatched'))
         ORDER BY l.completed_at
         LIMIT least(greatest(max_rows, 0), 100000)
           FOR UPDATE OF l SKIP LOCKED
    )
    DELETE FROM duetime.job_ledger l
     USING doomed d
     WHERE l.idempotency_key = d.idempotency_key;
    GET DIAGNOSTICS gone = ROW_COUNT;
    RETURN gone;
END $$;

REVOKE EXECUTE ON FUNCTION duetime.prune_ledger(float8, integer) FROM PUBLIC;
