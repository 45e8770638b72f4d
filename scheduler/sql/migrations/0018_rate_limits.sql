-- duetime 0018: rate limits (DESIGN §11; docs/architecture.md "Rate limits").
--
-- `duetime limits set task:NAME --rate 100/s` (also /min, /h; with --per-key per limit
-- key): at most `rate_count` jobs of the target start in any `rate_period` seconds,
-- cluster-wide. A start is a dispatch: the commit that marks the job `dispatched`. Each
-- shard's one fenced dispatcher decides it, as for max_running (migration 0016).
--
-- The window is a sliding one over a log of starts, `duetime.limit_starts`, not a
-- counter: the dispatcher writes one row per (target, key) and claim transaction, in
-- that same fenced transaction, after it marked the jobs dispatched, stamped with
-- statement_timestamp() (so at or after their dispatched_at); before its claim it sums
-- the rows of the last `rate_period` (limits.sql `starts`) and admits only what is left.
-- Claim transactions of a shard never overlap (one dispatcher; a new leader's fence
-- advance waits for the old one's), so every count sees every earlier start, and any
-- window of `rate_period` seconds, on the log or on the jobs' dispatched_at, holds at
-- most `rate_count` starts. A dispatch that does not commit leaves no row; a new leader
-- reads the same rows, so a failover neither resets the budget nor bursts.
-- `jobs.dispatched_at` alone cannot count starts: a retry resets it.
--
-- The maintainer deletes rows past their target's window (`prune_limit_starts`); no
-- other role writes the log.

ALTER TABLE duetime.limits
    ADD COLUMN rate_count integer,
    -- seconds: 1 (/s), 60 (/min) or 3600 (/h)
    ADD COLUMN rate_period integer;

ALTER TABLE duetime.limits ADD CONSTRAINT limits_rate_invalid CHECK (
    (rate_count IS NULL AND rate_period IS NULL)
    OR (rate_count IS NOT NULL AND rate_period IS NOT NULL
        AND rate_count BETWEEN 1 AND 1000000 AND rate_period IN (1, 60, 3600)));

-- A rate alone is a rule, and it may apply per key (the names stay: they are the
-- contract tests and operators see).
ALTER TABLE duetime.limits DROP CONSTRAINT limits_rule_missing;
ALTER TABLE duetime.limits ADD CONSTRAINT limits_rule_missing
    CHECK (max_running IS NOT NULL OR rate_count IS NOT NULL OR fair);
ALTER TABLE duetime.limits DROP CONSTRAINT limits_per_key_needs_max;
ALTER TABLE duetime.limits ADD CONSTRAINT limits_per_key_needs_max
    CHECK (NOT per_key OR max_running IS NOT NULL OR rate_count IS NOT NULL);

COMMENT ON COLUMN duetime.limits.rate_count IS
    'at most this many starts (dispatches) of the target per rate_period seconds';

CREATE TABLE duetime.limit_starts (
    -- the limit's target (`task:NAME` or `queue:NAME`); no foreign key: a removed
    -- limit's rows are pruned, and a limit set again at once still sees its window
    target     text        NOT NULL,
    -- the job's limit_key for a per-key rate, '' otherwise
    limit_key  text        NOT NULL DEFAULT '',
    started_at timestamptz NOT NULL,
    -- jobs of (target, key) the claim transaction dispatched
    starts     integer     NOT NULL,
    CONSTRAINT limit_starts_starts_positive CHECK (starts > 0)
);

-- The dispatcher's sum over a window reads this index (one range per rate-limited
-- target); the maintainer's prune reads the small table by its age.
CREATE INDEX limit_starts_window_idx ON duetime.limit_starts (target, started_at);

COMMENT ON TABLE duetime.limit_starts IS
    'starts of rate-limited targets, written by the fenced dispatcher, pruned past the window';
