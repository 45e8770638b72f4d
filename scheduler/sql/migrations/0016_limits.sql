-- duetime 0016: concurrency limits and the limit key (DESIGN §11; docs/architecture.md
-- "Limits").
--
-- `limit_key` text (NULL = none): what a per-key limit counts on (a tenant, a customer
-- id, an API host). Producers set it with plain SQL like `task`; a nullable column
-- without a default is a catalog-only change in every bucket. Its CHECK is NOT VALID as
-- in 0014 (every existing row is NULL; validating would scan every bucket under ACCESS
-- EXCLUSIVE); new rows are checked from the ALTER on and new buckets copy it.
--
-- `duetime.limits`: one row per limited (or fair) target, `task:NAME` or `queue:NAME`, written
-- only by the schema owner (`duetime limits set|remove`); the scheduler reads it. The
-- one fenced dispatcher of a shard enforces it in its claim (dispatch.sql
-- `limit_counts`, `claim_limited`): a job counts against a limit while its row is
-- `dispatched`, i.e. from the dispatch's commit until its outcome commits, so the
-- counts are derived from the rows at every claim and a worker's or leader's crash
-- can neither leak nor double-count a slot.
--
-- duetime.enqueue_unique (0014) takes the limit key from 0017 on.

ALTER TABLE duetime.jobs ADD COLUMN limit_key text;

ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_limit_key_invalid
    CHECK (limit_key IS NULL OR limit_key ~ '^[^[:cntrl:]]{1,200}$') NOT VALID;

COMMENT ON COLUMN duetime.jobs.limit_key IS
    'what per-key limits count on (1-200 characters, no control characters; NULL: none)';

CREATE TABLE duetime.limits (
    -- `task:<task name>` or `queue:<queue name>`
    target      text        NOT NULL,
    -- at most this many jobs of the target dispatched at once (per limit_key if per_key);
    -- NULL: no cap (a fair-only queue)
    max_running integer,
    per_key     boolean     NOT NULL DEFAULT false,
    -- a queue's due jobs start round-robin between their limit keys, not by run time
    fair        boolean     NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT limits_pkey PRIMARY KEY (target),
    -- the task rule of jobspec.validate_task (1-200 characters) without control
    -- characters, and the queue rule of queues_name_invalid (0008)
    CONSTRAINT limits_target_invalid CHECK (
        target ~ '^task:[^[:cntrl:]]{1,200}$'
        OR target ~ '^queue:[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$'),
    CONSTRAINT limits_max_running_positive CHECK (max_running BETWEEN 1 AND 1000000),
    CONSTRAINT limits_rule_missing CHECK (max_running IS NOT NULL OR fair),
    CONSTRAINT limits_per_key_needs_max CHECK (NOT per_key OR max_running IS NOT NULL),
    CONSTRAINT limits_fair_queue_only CHECK (NOT fair OR target LIKE 'queue:%')
);

COMMENT ON TABLE duetime.limits IS
    'concurrency limits the dispatcher enforces (duetime limits set|list|remove)';

-- The fair claim (limits.sql `claim_fair`) walks the distinct keys of a queue's pending
-- jobs by a loose index scan and takes each key's first jobs by priority and run time:
-- this index serves both. Partial on limit_key IS NOT NULL, so a job without a key (every
-- job before this migration, and every job of a producer that does not use keys) costs
-- its insert nothing more. Like 0015's index it is built on every bucket under a SHARE
-- lock (inserts wait for the build, which reads every bucket once and, every existing
-- row having a NULL key, writes nothing; its time on a large table is not measured here).
CREATE INDEX jobs_pending_key_idx
    ON duetime.jobs (queue, limit_key, priority DESC, (coalesce(run_at, due_at)))
    WHERE status = 'pending' AND limit_key IS NOT NULL;

-- The dispatcher's count of dispatched jobs per limited target reads the dispatched
-- rows through jobs_dispatched_idx (a partial index: only the broker's bounded buffer
-- and the running jobs), so no index is added here.
