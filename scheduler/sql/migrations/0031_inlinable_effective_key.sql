-- duetime 0031: a job's ledger key is computed in the statement that needs it, not by a
-- function call planned again for every statement
-- (docs/benchmarks.md, "The begin read and the ledger it looked up").
--
-- duetime.effective_key (0007) is IMMUTABLE, but its body joined numbers to text with
-- `text || bigint`, an operator that is only STABLE (it calls the number's output
-- function). PostgreSQL inlines a SQL function into its caller only when the body is no
-- more volatile than the function says, so it never inlined this one: every statement
-- that computes a key (the begin read, finish_attempt, the batched completions) parsed
-- and planned the function's body again, once per statement. For finish_attempt, one
-- statement per job, that was 8 % of its backend's CPU in a storm.
--
-- The numbers are now cast to text first (`bigint::text`, `integer::text`: the same
-- digits, IMMUTABLE), so the body is immutable and inlined. Same rule, same keys
-- (tests/integration/test_effective_key.py compares it with scheduler.messages).
CREATE OR REPLACE FUNCTION duetime.effective_key(id bigint, idempotency_key text,
                                                 schedule_id bigint, created_by text)
    RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE
        WHEN idempotency_key IS NULL OR idempotency_key = '' THEN 'job:' || id::text
        WHEN schedule_id IS NOT NULL
             AND starts_with(idempotency_key, 'schedule:' || schedule_id::text || ':')
            THEN idempotency_key
        ELSE 'key:' || length(coalesce(created_by, ''))::text || ':'
             || coalesce(created_by, '') || ':' || idempotency_key
    END;
