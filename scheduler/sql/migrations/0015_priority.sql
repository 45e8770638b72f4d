-- duetime 0015: job priorities (DESIGN §11; docs/architecture.md "Who decides the order").
--
-- `priority` smallint, default 0, higher starts first among the due jobs of a queue;
-- producers set it with plain SQL like `task` and `due_at`. A constant default is stored
-- in the catalog, so adding the column rewrites no partition. The CHECK is added
-- NOT VALID (no scan under the ACCESS EXCLUSIVE lock; every existing row holds the
-- default 0 anyway) and validated at once, which takes only a SHARE UPDATE EXCLUSIVE
-- lock; new rows are checked from the ALTER on.
--
-- The claim reads the fresh due jobs of declared queues by (priority DESC, run time)
-- from jobs_pending_priority_idx, declared on the partitioned parent like
-- jobs_pending_run_idx so every bucket, present and future, gets its own; the jobs that
-- waited longer than priority_max_wait are read first, oldest first, from
-- jobs_pending_run_idx (dispatch.sql, `claim`).

ALTER TABLE duetime.jobs ADD COLUMN priority smallint NOT NULL DEFAULT 0;

ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_priority_range
    CHECK (priority BETWEEN -100 AND 100) NOT VALID;
ALTER TABLE duetime.jobs VALIDATE CONSTRAINT jobs_priority_range;

CREATE INDEX jobs_pending_priority_idx
    ON duetime.jobs (priority DESC, (coalesce(run_at, due_at)))
    WHERE status = 'pending';

COMMENT ON COLUMN duetime.jobs.priority IS
    'higher starts first among due jobs of a queue (-100..100, default 0); a job due longer '
    'than priority_max_wait starts before fresher jobs whatever their priority';
