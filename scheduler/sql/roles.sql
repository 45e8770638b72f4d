-- Least-privilege PostgreSQL roles (docs/security.md), applied by `duetime migrate
-- --roles` (scheduler/roles.py) after the migrations, as the role that owns the schema.
--
-- Three NOLOGIN group roles; operators create login users IN ROLE one of them:
--   CREATE ROLE billing_app LOGIN PASSWORD '…' IN ROLE duetime_producer;
-- {producer}, {worker} and {scheduler} are the group role names (default prefix
-- "duetime"), checked by roles.py to be plain lower-case identifiers before they are
-- substituted, so they never need quoting beyond the double quotes below.
--
-- Idempotent and convergent: every run first revokes what these roles hold in the
-- duetime schema, then grants exactly the list below, so re-running after an upgrade
-- (or without --producer-schedules) also takes away what is no longer listed.
-- Column lists are the columns each component's SQL touches (scheduler/sql/*.sql);
-- a statement that needs a column not listed fails with "permission denied", which
-- tests/integration/test_roles.py catches by running the real code as each role.

-- name: create_roles
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['{producer}', '{worker}', '{scheduler}'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', r);
        END IF;
    END LOOP;
END $$;

-- name: revoke_all
REVOKE ALL ON ALL TABLES IN SCHEMA duetime FROM "{producer}", "{worker}", "{scheduler}";
REVOKE ALL ON ALL SEQUENCES IN SCHEMA duetime FROM "{producer}", "{worker}", "{scheduler}";
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA duetime FROM "{producer}", "{worker}", "{scheduler}";
REVOKE ALL ON SCHEMA duetime FROM "{producer}", "{worker}", "{scheduler}";
DROP POLICY IF EXISTS "{producer}_own_jobs" ON duetime.jobs;
DROP POLICY IF EXISTS "{producer}_insert_jobs" ON duetime.jobs;
DROP POLICY IF EXISTS "{worker}_jobs" ON duetime.jobs;
DROP POLICY IF EXISTS "{scheduler}_jobs" ON duetime.jobs;
DROP POLICY IF EXISTS "{producer}_own_schedules" ON duetime.schedules;
DROP POLICY IF EXISTS "{producer}_insert_schedules" ON duetime.schedules;
DROP POLICY IF EXISTS "{scheduler}_schedules" ON duetime.schedules;

-- name: grant_common
GRANT USAGE ON SCHEMA duetime TO "{producer}", "{worker}", "{scheduler}";
-- Row-level security on the tables producers share: a producer sees only the rows it
-- inserted. Roles without a policy see no row at all (fail closed); the owner (who
-- runs migrations and operator commands) is not subject to it.
ALTER TABLE duetime.jobs ENABLE ROW LEVEL SECURITY;
ALTER TABLE duetime.schedules ENABLE ROW LEVEL SECURITY;

-- name: grant_producer
-- INSERT of the contract columns only (DESIGN §3): status, attempt, run_at, epochs,
-- created_by ... keep their defaults, so a producer cannot insert a row that looks
-- dispatched, finished, or someone else's. SELECT is needed by INSERT ... RETURNING
-- and to read status; row-level security limits it to the producer's own rows.
-- No UPDATE/DELETE: no cancel, no retry, no claim (FOR UPDATE needs UPDATE).
-- unique_key (migration 0014): the key is claimed by a SECURITY DEFINER trigger, so the
-- producer holds no privilege on duetime.unique_keys and cannot read other scopes' keys.
-- limit_key (migration 0016): a producer names the key its job counts under; the limits
-- themselves are the owner's (duetime.limits: no grant here).
-- timeout_s, max_snoozes (migration 0019): the job's own handler time limit and bound on
-- snoozes. tags, meta (migration 0022): what the job is about, and the producer's own data.
-- traceparent (migration 0023): the enqueuing code's trace context.
GRANT INSERT (task, payload, due_at, queue, max_attempts, idempotency_key, unique_key,
                  priority, limit_key, timeout_s, max_snoozes, tags, meta, traceparent,
                  depends_on, on_dependency_failure, workflow_id)
    ON duetime.jobs TO "{producer}";
GRANT SELECT ON duetime.jobs TO "{producer}";
GRANT USAGE ON SEQUENCE duetime.jobs_id_seq TO "{producer}";
-- depends_on, on_dependency_failure, workflow_id (migration 0025): workflows; the
-- dependencies are checked and the edges written by SECURITY DEFINER triggers.
GRANT USAGE ON SEQUENCE duetime.workflow_id_seq TO "{producer}";
-- JobStore.result (migration 0019): register as a waiter for a job's outcome.
GRANT EXECUTE ON FUNCTION duetime.await_job(bigint), duetime.unawait_job(bigint)
    TO "{producer}";
CREATE POLICY "{producer}_insert_jobs" ON duetime.jobs FOR INSERT TO "{producer}"
    WITH CHECK (created_by = current_user);
CREATE POLICY "{producer}_own_jobs" ON duetime.jobs FOR SELECT TO "{producer}"
    USING (created_by = current_user);

-- name: grant_producer_schedules
-- Only with --producer-schedules: recurring schedules are a standing order to run
-- code, which some shops keep for operators.
GRANT INSERT (name, task, payload, queue, max_attempts, cron, interval, timezone,
              start_at, end_at, paused, misfire_policy, misfire_cap, overlap_policy, jitter)
    ON duetime.schedules TO "{producer}";
GRANT SELECT ON duetime.schedules TO "{producer}";
CREATE POLICY "{producer}_insert_schedules" ON duetime.schedules FOR INSERT TO "{producer}"
    WITH CHECK (created_by = current_user);
CREATE POLICY "{producer}_own_schedules" ON duetime.schedules FOR SELECT TO "{producer}"
    USING (created_by = current_user);

-- name: grant_worker
-- No privilege on duetime.jobs or duetime.job_ledger: handlers run ctx.db as the
-- worker's login, so a table grant here would be the handler's too. Every statement of
-- execution.sql calls one of migration 0009's SECURITY DEFINER functions, which settle
-- only a row that is `dispatched` at the attempt named (succeeded with its ledger row,
-- pending at attempt + 1, dead, or a heartbeat) and read a batch of deliveries' rows
-- (worker_begin, which also takes the attempt's guard lock, migration 0012, released by
-- worker_release). Not DELETE, not the fence, not INSERT into jobs, not schedules.
-- Handlers' own tables (ctx.db) are the application's to grant to the worker login user.
GRANT EXECUTE ON FUNCTION duetime.worker_begin(bigint[], timestamptz[]),
                          duetime.worker_begin(bigint[], timestamptz[], integer[], bigint[],
                                               bigint[], integer[], bigint[]),
                          duetime.worker_release(bigint[], integer[], bigint[]),
                          duetime.attempt_guard(bigint, integer, bigint),
                          duetime.worker_complete(bigint[], timestamptz[], integer[], text),
                          duetime.worker_finish_group(bigint[], timestamptz[], integer[],
                                                      text, timestamptz, timestamptz),
                          duetime.finish_attempt(bigint, timestamptz, integer, text),
                          duetime.worker_retry(bigint, timestamptz, integer, float8, text,
                                               text),
                          duetime.worker_dead(bigint, timestamptz, integer, text, text),
                          duetime.worker_heartbeat(bigint, timestamptz, integer),
                          duetime.worker_begin_jobs(bigint[], timestamptz[], integer[],
                                                    bigint[], bigint[], integer[], bigint[]),
                          duetime.worker_complete(bigint[], timestamptz[], integer[], text,
                                                  jsonb[]),
                          duetime.worker_finish_group(bigint[], timestamptz[], integer[],
                                                      text, timestamptz, timestamptz,
                                                      jsonb[]),
                          duetime.finish_attempt(bigint, timestamptz, integer, text, jsonb),
                          duetime.worker_snooze(bigint, timestamptz, integer, float8),
                          duetime.worker_cancelled(bigint[]),
                          duetime.worker_progress(bigint, timestamptz, integer, real, text),
                          duetime.worker_begin_traced(bigint[], timestamptz[], integer[],
                                                      bigint[], bigint[], integer[], bigint[]),
                          duetime.worker_begin_flow(bigint[], timestamptz[], integer[],
                                                    bigint[], bigint[], integer[], bigint[]),
                          duetime.worker_unstage(bigint[], timestamptz[], integer[], bigint[])
    TO "{worker}";
-- `duetime worker --queue NAME` warns at start when NAME is not declared.
GRANT SELECT ON duetime.queues TO "{worker}";

-- name: grant_scheduler
-- Fence (fence.sql); dispatch and reconcile (dispatch.sql); planner (schedules.sql
-- claim_due, apply_plan, prune_fires); maintainer (maintenance.sql): bucket DDL and
-- DEFAULT's and the ledger's pruning only through SECURITY DEFINER functions
-- (migrations 0005, 0010, 0013);
-- `duetime status`/readiness (status.sql). Not INSERT/DELETE on the fence, not
-- producer columns of schedules, no DDL of its own.
GRANT SELECT, UPDATE (epoch, leader_node, elected_at, renewed_at)
    ON duetime.leader_fence TO "{scheduler}";
GRANT SELECT ON duetime.jobs TO "{scheduler}";
GRANT UPDATE (status, dispatched_at, heartbeat_at, dispatch_epoch, republish_count,
              last_error, finished_at)
    ON duetime.jobs TO "{scheduler}";
GRANT INSERT (id, task, payload, queue, max_attempts, due_at, idempotency_key, schedule_id)
    ON duetime.jobs TO "{scheduler}";
GRANT USAGE ON SEQUENCE duetime.jobs_id_seq TO "{scheduler}";
GRANT SELECT ON duetime.schedules TO "{scheduler}";
-- The claim dispatches only jobs of declared queues (dispatch.sql). Declaring one is an
-- operator's act (`duetime queues add`, as the schema owner): no role here may insert.
GRANT SELECT ON duetime.queues TO "{scheduler}";
-- The dispatcher enforces the limits (migration 0016); setting one is the owner's act
-- (`duetime limits set`), as declaring a queue is.
GRANT SELECT ON duetime.limits TO "{scheduler}";
-- Rate limits (migration 0018): the dispatcher logs its starts, the maintainer prunes.
GRANT SELECT, INSERT, DELETE ON duetime.limit_starts TO "{scheduler}";
GRANT UPDATE (next_fire_at, plan_at, buffered_fire_at, paused, last_error, fired_count,
              skipped_count, missed_count, last_fired_at, last_job_id, last_job_due_at)
    ON duetime.schedules TO "{scheduler}";
GRANT SELECT, INSERT, DELETE ON duetime.schedule_fires TO "{scheduler}";
-- The ledger is pruned only through duetime.prune_ledger (migration 0013): no DELETE.
GRANT SELECT ON duetime.job_ledger TO "{scheduler}";
GRANT SELECT ON duetime.schema_migrations TO "{scheduler}";
-- The maintainer's box (migration 0010): create buckets from today to today + 100 days,
-- detach buckets whose range ended and whose rows are all terminal, drop what it
-- detached, delete terminal rows of DEFAULT past the retention, prune the ledger past
-- the retention (never under a day, never a live job's row). Not ensure_partition(s)
-- (any day, any number of days: the owner's), not DELETE on jobs_default.
GRANT EXECUTE ON FUNCTION duetime.create_bucket(date),
                          duetime.detach_terminal_partition(date),
                          duetime.drop_detached_partition(text),
                          duetime.partition_is_live(regclass),
                          duetime.prune_default(float8, integer),
                          duetime.prune_ledger(float8, integer)
    TO "{scheduler}";
CREATE POLICY "{scheduler}_jobs" ON duetime.jobs FOR ALL TO "{scheduler}"
    USING (true) WITH CHECK (true);
CREATE POLICY "{scheduler}_schedules" ON duetime.schedules FOR ALL TO "{scheduler}"
    USING (true) WITH CHECK (true);

-- name: drop_roles
-- Uninstall (and test cleanup): in the current database, revoke everything and drop the
-- policies naming these roles, then drop the roles. Roles are cluster-wide: run
-- DROP OWNED BY in every other database where they were granted something first.
DROP OWNED BY "{producer}", "{worker}", "{scheduler}";
DROP ROLE IF EXISTS "{producer}", "{worker}", "{scheduler}";
