-- duetime 0021: schedules as code (DESIGN §13 item 5; scheduler/planning/declared.py).
--
-- `managed_by` text (NULL = created by hand): the source of the declaration that owns
-- the schedule (`duetime schedules apply FILE`, `ScheduleStore.apply`). `--prune`
-- removes only schedules of its own source that the file no longer declares, never one
-- created by hand or by another source. Plain SQL may set it like any column; the CHECK
-- names what a source may be. A nullable column without a default is a catalog-only
-- change; the table holds schedules, not jobs, so the CHECK is validated at once.

ALTER TABLE duetime.schedules ADD COLUMN managed_by text;

ALTER TABLE duetime.schedules ADD CONSTRAINT schedules_managed_by_invalid
    CHECK (managed_by IS NULL OR managed_by ~ '^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,199}$');

COMMENT ON COLUMN duetime.schedules.managed_by IS
    'source of the declaration that owns this schedule (schedules as code); NULL: by hand';

-- The schedules of one source, read by every apply of it.
CREATE INDEX schedules_managed_by_idx ON duetime.schedules (managed_by)
    WHERE managed_by IS NOT NULL;
