-- duetime 0001: jobs (time-partitioned), idempotency ledger, leader fence.
-- Contract (DESIGN §3): producers INSERT INTO duetime.jobs (task, payload, due_at, queue,
-- max_attempts, idempotency_key); every other column is owned by the system.

CREATE SCHEMA IF NOT EXISTS duetime;

CREATE SEQUENCE duetime.jobs_id_seq AS bigint;

CREATE TABLE duetime.jobs (
    id              bigint      NOT NULL DEFAULT nextval('duetime.jobs_id_seq'),
    task            text        NOT NULL,
    payload         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    queue           text        NOT NULL DEFAULT 'default',
    -- due_at is the partition key and never changes after insert, so no row ever moves
    -- between partitions. run_at is when the job may next run: NULL means due_at; retry
    -- backoff and manual retries set it (always >= due_at, which lets claims add the
    -- redundant predicate due_at <= now() and prune future partitions).
    due_at          timestamptz NOT NULL DEFAULT now(),
    run_at          timestamptz,
    status          text        NOT NULL DEFAULT 'pending',
    attempt         integer     NOT NULL DEFAULT 1,
    max_attempts    integer     NOT NULL DEFAULT 5,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    dispatched_at   timestamptz,
    heartbeat_at    timestamptz,
    finished_at     timestamptz,
    dispatch_epoch  bigint,
    last_error      text,
    schedule_id     bigint,
    CONSTRAINT jobs_pkey PRIMARY KEY (id, due_at),
    CONSTRAINT jobs_task_not_empty CHECK (length(btrim(task)) > 0),
    CONSTRAINT jobs_task_too_long CHECK (length(task) <= 200),
    CONSTRAINT jobs_queue_name_invalid CHECK (queue ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$'),
    CONSTRAINT jobs_max_attempts_out_of_range CHECK (max_attempts BETWEEN 1 AND 1000),
    CONSTRAINT jobs_attempt_out_of_range CHECK (attempt >= 1),
    CONSTRAINT jobs_payload_not_object CHECK (jsonb_typeof(payload) = 'object'),
    CONSTRAINT jobs_status_invalid CHECK (
        status IN ('pending', 'dispatched', 'succeeded', 'dead', 'cancelled')),
    CONSTRAINT jobs_due_at_not_finite CHECK (isfinite(due_at)),
    CONSTRAINT jobs_run_at_before_due_at CHECK (run_at IS NULL OR run_at >= due_at),
    CONSTRAINT jobs_idempotency_key_invalid CHECK (
        idempotency_key IS NULL OR length(idempotency_key) BETWEEN 1 AND 500)
) PARTITION BY RANGE (due_at);

COMMENT ON TABLE duetime.jobs IS
    'duetime jobs; producers insert (task, payload, due_at[, queue, max_attempts, idempotency_key])';

-- The hot index: only pending rows, keyed by run time. Finished rows never enter it,
-- so claim cost stays flat as history piles up.
CREATE INDEX jobs_pending_run_idx ON duetime.jobs ((coalesce(run_at, due_at)))
    WHERE status = 'pending';
-- The reconciler's index: dispatched rows by their last sign of life.
CREATE INDEX jobs_dispatched_idx ON duetime.jobs ((coalesce(heartbeat_at, dispatched_at)))
    WHERE status = 'dispatched';
-- Lookups by id alone (CLI, API); workers also know due_at and get partition pruning.
CREATE INDEX jobs_id_idx ON duetime.jobs (id);
CREATE INDEX jobs_schedule_idx ON duetime.jobs (schedule_id, due_at)
    WHERE schedule_id IS NOT NULL;

CREATE TABLE duetime.jobs_default PARTITION OF duetime.jobs DEFAULT;

-- Daily buckets. Creating a bucket moves the rows that landed in DEFAULT for that day
-- into it first (ATTACH would otherwise fail), all in the caller's transaction.
CREATE FUNCTION duetime.partition_name(day date) RETURNS text
    LANGUAGE sql IMMUTABLE AS $$ SELECT 'jobs_p' || to_char(day, 'YYYYMMDD') $$;

CREATE FUNCTION duetime.ensure_partition(day date) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    part text := duetime.partition_name(day);
    lo timestamptz := day::timestamp AT TIME ZONE 'UTC';
    hi timestamptz := (day + 1)::timestamp AT TIME ZONE 'UTC';
BEGIN
    IF to_regclass(format('duetime.%I', part)) IS NOT NULL THEN
        RETURN false;
    END IF;
    EXECUTE format(
        'CREATE TABLE duetime.%I (LIKE duetime.jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
        part);
    -- Queue-shaped table: vacuum early so dead tuples do not bloat the pending index.
    EXECUTE format(
        'ALTER TABLE duetime.%I SET (autovacuum_vacuum_scale_factor = 0.01, '
        'autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_insert_scale_factor = 0.05, '
        'autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 1, '
        'fillfactor = 85)', part);
    EXECUTE format(
        'WITH moved AS (DELETE FROM duetime.jobs_default WHERE due_at >= $1 AND due_at < $2 '
        'RETURNING *) INSERT INTO duetime.%I SELECT * FROM moved', part)
        USING lo, hi;
    EXECUTE format(
        'ALTER TABLE duetime.jobs ATTACH PARTITION duetime.%I FOR VALUES FROM (%L) TO (%L)',
        part, lo, hi);
    RETURN true;
END $$;

CREATE FUNCTION duetime.ensure_partitions(first_day date, days integer) RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    created integer := 0;
BEGIN
    FOR i IN 0 .. days - 1 LOOP
        IF duetime.ensure_partition(first_day + i) THEN
            created := created + 1;
        END IF;
    END LOOP;
    RETURN created;
END $$;

SELECT duetime.ensure_partitions(((now() AT TIME ZONE 'UTC')::date - 1), 16);

ALTER TABLE duetime.jobs_default SET (
    autovacuum_vacuum_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.02);

-- Wake-up signal for the dispatcher: one NOTIFY per INSERT statement (not per row), so
-- a COPY of 100k rows costs one notification. The dispatcher reacts by re-reading the
-- earliest pending run time (a 0.2 ms prepared probe). Identical notifications within a
-- transaction are folded into one by PostgreSQL.
CREATE FUNCTION duetime.notify_jobs_inserted() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('duetime_jobs', '');
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_notify_insert AFTER INSERT ON duetime.jobs
    FOR EACH STATEMENT EXECUTE FUNCTION duetime.notify_jobs_inserted();

-- Idempotency ledger: one row per completed idempotency key, inserted in the same
-- transaction as the handler's ctx.db work and the job's terminal update.
CREATE TABLE duetime.job_ledger (
    idempotency_key text        PRIMARY KEY,
    job_id          bigint      NOT NULL,
    attempt         integer     NOT NULL,
    task            text        NOT NULL,
    worker          text,
    completed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX job_ledger_completed_idx ON duetime.job_ledger (completed_at);
ALTER TABLE duetime.job_ledger SET (autovacuum_vacuum_scale_factor = 0.02);

-- Fence: the newest leader epoch. Every claim transaction locks this row FOR SHARE and
-- checks epoch = its own; a new leader's UPDATE waits for in-flight claims and then
-- makes every older leader's next claim fail.
CREATE TABLE duetime.leader_fence (
    shard       integer     PRIMARY KEY DEFAULT 0 CHECK (shard >= 0),
    epoch       bigint      NOT NULL DEFAULT 0,
    leader_node text,
    elected_at  timestamptz,
    renewed_at  timestamptz
);
INSERT INTO duetime.leader_fence (shard) VALUES (0) ON CONFLICT DO NOTHING;
