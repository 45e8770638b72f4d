-- Workflows (DESIGN §16; migration 0025; scheduler/workflow.py builds the rows,
-- scheduler/store/workflows.py runs these).

-- name: next_workflow_id
SELECT nextval('duetime.workflow_id_seq') AS workflow_id;

-- name: insert_layer
-- One layer of a workflow (steps whose dependencies were inserted by earlier layers),
-- from a JSON array of row documents (Workflow.rows) in step order. Absent values take
-- the columns' defaults. The ids come from the sequence in the order the rows are
-- inserted, which is the ORDER BY: the caller sorts the returned rows by id to match
-- them to its steps (RETURNING itself promises no order). The dependencies are checked,
-- locked and their edges written by the triggers of migration 0025.
INSERT INTO duetime.jobs (task, payload, queue, due_at, max_attempts, priority,
                          idempotency_key, limit_key, tags, meta, timeout_s, depends_on,
                          on_dependency_failure, workflow_id)
SELECT r.task, coalesce(r.payload, '{}'::jsonb), coalesce(r.queue, 'default'),
       coalesce(r.due_at, now()), coalesce(r.max_attempts, 5), coalesce(r.priority, 0),
       r.idempotency_key, r.limit_key, coalesce(r.tags, '{}'::text[]),
       coalesce(r.meta, '{}'::jsonb), r.timeout_s, r.depends_on,
       coalesce(r.on_dependency_failure, 'cancel'), $2::bigint
  FROM jsonb_array_elements($1::text::jsonb) WITH ORDINALITY AS e(doc, n)
 CROSS JOIN LATERAL jsonb_to_record(e.doc) AS r(
           task text, payload jsonb, queue text, due_at timestamptz, max_attempts integer,
           priority integer, idempotency_key text, limit_key text, tags text[], meta jsonb,
           timeout_s float8, depends_on bigint[], on_dependency_failure text)
 ORDER BY e.n
RETURNING *;

-- name: workflow_jobs
-- Every job of a workflow, oldest first (the CLI, the dashboard): partial index
-- jobs_workflow_idx.
SELECT * FROM duetime.jobs WHERE workflow_id = $1 ORDER BY id LIMIT $2;

-- name: cancel_workflow_ids
-- The unfinished jobs of a workflow, for JobStore's cancel transition.
SELECT id FROM duetime.jobs
 WHERE workflow_id = $1 AND status IN ('pending', 'dispatched', 'waiting')
 ORDER BY id;
