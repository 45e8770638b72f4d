-- duetime 0007: a producer's idempotency key is its own (docs/security.md, "Idempotency
-- keys are scoped by producer"; the contract in docs/architecture.md).
--
-- Before, the ledger key of a job was its idempotency_key as the producer wrote it, else
-- `job:<id>`, and a planned fire's was `schedule:<id>:<fire time>`. Both derived forms are
-- guessable (ids come from a sequence, fire times from a cron expression), so one INSERT
-- planting future keys (`job:1234`, `schedule:7:2027-01-01T00:00:00Z`) settled other
-- producers' jobs and fires as duplicates, "succeeded" without running. Now:
--
-- 1. The effective (ledger) key has one definition in SQL, duetime.effective_key(), the
--    twin of scheduler.messages.effective_key (tests/integration/test_effective_key.py):
--      no key (NULL or '')                          -> job:<id>
--      schedule_id set, key `schedule:<that id>:…`  -> the key as written (the planner's
--                                                      and `schedules trigger`'s keys;
--                                                      only the scheduler role and the
--                                                      owner may set schedule_id)
--      any other key K                              -> key:<n>:<created_by>:K
--    where <n> is the length of created_by in characters, so no choice of role name and
--    key can spell another producer's scope ('a:b' + 'c' vs 'a' + 'b:c'). created_by is
--    current_user at insert time (migration 0005) and not producer-settable, so two
--    producers' keys never meet in the ledger; producers meant to share a key space log
--    in as, or SET ROLE to, the same producer role.
-- 2. Producers cannot write a key in the system's forms: CHECK
--    jobs_idempotency_key_reserved refuses keys starting with `job:`, `key:` or
--    `schedule:`, except `schedule:<schedule_id>:…` on a row that carries that
--    schedule_id (which a producer cannot set).

CREATE FUNCTION duetime.effective_key(id bigint, idempotency_key text, schedule_id bigint,
                                      created_by text)
    RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE
        WHEN idempotency_key IS NULL OR idempotency_key = '' THEN 'job:' || id
        WHEN schedule_id IS NOT NULL
             AND starts_with(idempotency_key, 'schedule:' || schedule_id || ':')
            THEN idempotency_key
        ELSE 'key:' || length(coalesce(created_by, '')) || ':' || coalesce(created_by, '')
             || ':' || idempotency_key
    END;

COMMENT ON FUNCTION duetime.effective_key(bigint, text, bigint, text) IS
    'a job''s ledger key (migration 0007): job:<id>, a schedule''s own key, else '
    'key:<length(created_by)>:<created_by>:<idempotency_key>';

-- Existing ledger rows of producer keys move to their scoped form, so an effect recorded
-- before the upgrade still deduplicates redeliveries of the same job after it (the
-- worker now looks the scoped key up). Only rows whose job is still there can be mapped
-- (retention may have deleted the job: its key keeps the old form and matches nothing
-- new). This also releases the jobs a planted key had already been blocking: the
-- planter's ledger row `job:1234` becomes `key:…:job:1234`.
UPDATE duetime.job_ledger l
   SET idempotency_key = duetime.effective_key(j.id, j.idempotency_key, j.schedule_id,
                                               j.created_by)
  FROM duetime.jobs j
 WHERE j.id = l.job_id
   AND j.idempotency_key = l.idempotency_key
   AND duetime.effective_key(j.id, j.idempotency_key, j.schedule_id, j.created_by)
       <> l.idempotency_key;

-- Rows already holding a key in a reserved form are parked before the constraint exists,
-- so the migration never fails on them and every row complies afterwards (the maintainer
-- moves rows between buckets by INSERT, which checks): the key is cleared, and a job
-- that could still run goes dead with last_error naming the key (cut to 100 characters).
UPDATE duetime.jobs
   SET status = CASE WHEN status IN ('pending', 'dispatched') THEN 'dead' ELSE status END,
       finished_at = CASE WHEN status IN ('pending', 'dispatched') THEN now()
                          ELSE finished_at END,
       last_error = CASE WHEN status IN ('pending', 'dispatched')
                         THEN format('idempotency key %L uses a prefix reserved for keys '
                                     'duetime derives (job:, key:, schedule:); parked as '
                                     'dead, the key cleared', left(idempotency_key, 100))
                         ELSE last_error END,
       idempotency_key = NULL
 WHERE (starts_with(idempotency_key, 'job:') OR starts_with(idempotency_key, 'key:')
        OR starts_with(idempotency_key, 'schedule:'))
   AND NOT (schedule_id IS NOT NULL
            AND starts_with(idempotency_key, 'schedule:' || schedule_id || ':'));

-- NOT VALID as in 0005/0006: the UPDATE above left nothing to find, and validating would
-- scan every bucket under ACCESS EXCLUSIVE. New and updated rows are checked; new buckets
-- copy it (ensure_partition: LIKE ... INCLUDING CONSTRAINTS).
ALTER TABLE duetime.jobs ADD CONSTRAINT jobs_idempotency_key_reserved
    CHECK (idempotency_key IS NULL
           OR NOT (starts_with(idempotency_key, 'job:') OR starts_with(idempotency_key, 'key:')
                   OR starts_with(idempotency_key, 'schedule:'))
           OR (schedule_id IS NOT NULL
               AND starts_with(idempotency_key, 'schedule:' || schedule_id || ':')))
    NOT VALID;
