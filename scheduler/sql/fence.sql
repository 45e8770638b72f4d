-- Leader fence (DESIGN §4). Shard 0 until dispatch is sharded.

-- name: lock
SELECT epoch FROM duetime.leader_fence WHERE shard = 0 FOR SHARE;

-- name: advance
-- A new leader raises the fence to its epoch. Waits for in-flight claims (they hold the
-- row FOR SHARE); returns nothing if a newer epoch is already there.
UPDATE duetime.leader_fence
   SET epoch = $1, leader_node = $2, elected_at = now(), renewed_at = now()
 WHERE shard = 0 AND epoch <= $1
RETURNING epoch;

-- name: heartbeat
UPDATE duetime.leader_fence SET renewed_at = now()
 WHERE shard = 0 AND epoch = $1
RETURNING epoch;

-- name: read
SELECT epoch, leader_node, elected_at, renewed_at FROM duetime.leader_fence WHERE shard = 0;
