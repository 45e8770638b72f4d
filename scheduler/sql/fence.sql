-- Leader fence (DESIGN §4; scheduler/store/fence.py): the row of shard 0, the one dispatch uses.

-- name: lock
SELECT epoch FROM duetime.leader_fence WHERE shard = 0 FOR SHARE;

-- name: advance
-- A new leader raises the fence to its epoch. Waits for in-flight claims (they hold the
-- row FOR SHARE); returns nothing if a newer epoch is already there.
UPDATE duetime.leader_fence
   SET epoch = $1, leader_node = $2, elected_at = now(), renewed_at = now()
 WHERE shard = 0 AND epoch <= $1
RETURNING epoch;

-- name: advance_limits
-- $1 lock_timeout, $2 statement_timeout of the advancing transaction (SET LOCAL).
SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true);

-- name: terminate_blockers
-- The sessions that block the advancing backend $1 and are an older leader's fenced
-- transactions: named duetime:<node id>, holding row-level locks on leader_fence (FOR
-- SHARE takes RowShareLock on the table; a fence write RowExclusiveLock) and nothing
-- stronger. Others are left alone: an operator's psql, a migration's DDL (it holds
-- ShareUpdateExclusiveLock or more), any session without a lock on the fence.
-- pg_terminate_backend ends even a backend blocked sending to a frozen client.
SELECT a.pid, a.application_name, a.state, a.wait_event,
       pg_terminate_backend(a.pid) AS terminated
  FROM pg_stat_activity AS a
 WHERE a.pid = ANY(pg_blocking_pids($1))
   AND a.pid <> pg_backend_pid()
   AND a.application_name LIKE 'duetime:%'
   AND EXISTS (SELECT 1 FROM pg_locks AS l
                WHERE l.pid = a.pid AND l.granted AND l.locktype = 'relation'
                  AND l.relation = 'duetime.leader_fence'::regclass
                  AND l.mode IN ('RowShareLock', 'RowExclusiveLock'))
   AND NOT EXISTS (SELECT 1 FROM pg_locks AS l
                    WHERE l.pid = a.pid AND l.locktype = 'relation'
                      AND l.relation = 'duetime.leader_fence'::regclass
                      AND l.mode NOT IN ('AccessShareLock', 'RowShareLock',
                                         'RowExclusiveLock'));

-- name: heartbeat
UPDATE duetime.leader_fence SET renewed_at = now()
 WHERE shard = 0 AND epoch = $1
RETURNING epoch;

-- name: read
SELECT epoch, leader_node, elected_at, renewed_at FROM duetime.leader_fence WHERE shard = 0;
