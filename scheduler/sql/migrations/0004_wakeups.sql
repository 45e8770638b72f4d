-- duetime 0004: wake-ups without an insert trigger.
--
-- 0001 sent one NOTIFY per INSERT statement from a trigger. Measured here
-- (docs/foundation-measurements.md): every committing transaction that carries a NOTIFY
-- takes PostgreSQL's database-wide notify lock and holds it through its WAL flush, so 8
-- concurrent producers inserting one job each ran 1.4x-3.4x slower, and COPY paid
-- +5-15 %. The dispatcher now probes the earliest pending run time every
-- probe_interval (a 0.2 ms prepared query), which finds rows inserted by plain SQL
-- within tens of milliseconds and learns future due times ahead of time; the client API
-- and the CLI still NOTIFY for jobs due within a second, for millisecond wake-ups.
DROP TRIGGER IF EXISTS jobs_notify_insert ON duetime.jobs;
DROP FUNCTION IF EXISTS duetime.notify_jobs_inserted();
