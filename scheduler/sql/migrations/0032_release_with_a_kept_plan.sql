-- duetime 0032: releasing attempt guards no longer plans its statement at every call
-- (docs/benchmarks.md, "The begin read and the ledger it looked up").
--
-- duetime.worker_release (0012) is a SQL function with SET clauses (search_path, and
-- client_min_messages to keep the warning of an unlock that held nothing from the
-- client). A SQL function with a SET clause is never inlined, and the function manager
-- parses and plans its body again for every statement that calls it. The worker calls
-- it in nearly every begin read (the guards settled since the last one ride along,
-- worker_begin_flow) and in release_guards: about 0.1 ms of PostgreSQL CPU per call,
-- 0.012 ms per delivery at 8 deliveries per begin read (0.028 -> 0.040 ms measured).
--
-- As PL/pgSQL the same statement is planned once per session and kept, on its generic
-- plan whatever the session's plan_cache_mode (through a transaction pooler the store
-- pool cannot set it). Same locks released, same count returned. CREATE OR REPLACE keeps
-- the owner and the grants (roles.sql).
CREATE OR REPLACE FUNCTION duetime.worker_release(job_ids bigint[], attempts integer[],
                                                  epochs bigint[])
    RETURNS integer
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET client_min_messages = error
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN (SELECT count(*) FILTER (WHERE pg_advisory_unlock((g >> 32)::integer,
                                                            ((g & 4294967295)
                                                             - 2147483648)::integer))::integer
              FROM unnest(job_ids, attempts, epochs) AS w(id, attempt, epoch)
             CROSS JOIN LATERAL duetime.attempt_guard(w.id, w.attempt, w.epoch) AS g);
END $$;
