-- duetime 0020: the attempt guard's key is computed inline (docs/benchmarks.md, "The
-- attempt guard and the broker buffer, recovered").
--
-- duetime.attempt_guard (migration 0012) carried `SET search_path`, and a SQL function
-- with a SET clause is never inlined: every call went through the function manager with
-- a GUC save and restore, 12.7 µs a call measured (100,000 calls: 1,270 ms), against
-- 0.5 µs for the same expression inlined (52 ms). worker_begin called it twice per row
-- and worker_release once, so a delivery paid ~38 µs of PostgreSQL CPU for its key
-- alone, more than the advisory lock and unlock themselves (~1 µs each).
--
-- Inlining needs a plain SQL body without SET; what the SET protected against (a
-- function or operator of the caller's search_path taking the place of the intended
-- one) is ruled out instead by naming every function, type and operator in pg_catalog.
-- The key is unchanged for every (id, attempt, epoch) (same expression, same seed), so
-- workers of either version see each other's guards during a rolling upgrade.
-- CREATE OR REPLACE keeps the function's owner and its grants (roles.sql).

CREATE OR REPLACE FUNCTION duetime.attempt_guard(job_id bigint, job_attempt integer,
                                                 job_epoch bigint)
    RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.hashtextextended(
               job_id::pg_catalog.text
               OPERATOR(pg_catalog.||) ':'::pg_catalog.text
               OPERATOR(pg_catalog.||) job_attempt::pg_catalog.text
               OPERATOR(pg_catalog.||) ':'::pg_catalog.text
               OPERATOR(pg_catalog.||) COALESCE(job_epoch::pg_catalog.text,
                                                ''::pg_catalog.text),
               20261203::pg_catalog.int8)
$$;
