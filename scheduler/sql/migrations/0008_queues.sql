-- duetime 0008: declared queues (the broker fan-out issue).
--
-- Before this, every distinct `queue` a producer wrote into duetime.jobs became a quorum
-- queue the leader declared on RabbitMQ: one INSERT per name, and a producer could make
-- the broker create queues without bound (measured: a thousand names made RabbitMQ stop
-- answering new connections for every vhost). Now queues are declared by the operator
-- (`duetime queues add NAME`): the dispatcher claims, and so publishes and declares on
-- the broker, only jobs whose queue is a row of this table. Jobs for any other name stay
-- pending ("held", counted in duetime_jobs_held{reason="queue_undeclared"}) until the
-- queue is added; no restart is needed, the claim reads this table in its transaction.
--
-- The name rule is the one jobs.queue and schedules.queue already have (0001, 0002), so
-- every declarable name is one a job can carry and the other way round.
CREATE TABLE duetime.queues (
    name       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- for job control (pause/resume); nothing reads it yet
    paused     boolean     NOT NULL DEFAULT false,
    CONSTRAINT queues_pkey PRIMARY KEY (name),
    CONSTRAINT queues_name_invalid CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$')
);

COMMENT ON TABLE duetime.queues IS
    'queues declared by the operator (duetime queues add); only their jobs are dispatched';

-- Upgrades keep working: `default`, every queue a live job is in, and every queue a
-- schedule materializes into are declared now, as they implicitly were before.
INSERT INTO duetime.queues (name)
SELECT 'default'
UNION
SELECT DISTINCT queue FROM duetime.jobs WHERE status IN ('pending', 'dispatched')
UNION
SELECT DISTINCT queue FROM duetime.schedules
ON CONFLICT (name) DO NOTHING;
