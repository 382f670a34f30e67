-- What ended each job attempt (docs/faults.md): one row per failure, with the node it happened
-- on and whether the node was blamed (excluded from the job until it passes a preflight, and
-- counted towards a fleet-wide cordon) and whether it counted against the job's max_restarts.
CREATE TABLE failures (
    id        INTEGER PRIMARY KEY,                  -- monotonic; orders the failures
    job_id    INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt   INTEGER NOT NULL,                     -- the attempt that failed
    at_ms     INTEGER NOT NULL,                     -- when it was detected
    kind      TEXT    NOT NULL
              CHECK (kind IN ('rank_exit', 'host_lost', 'rank_lost', 'preflight', 'hang',
                             'preemption', 'drain', 'preempted')),
    agent_id  TEXT,                                 -- node it happened on (agents.agent_id), NULL if none
    rank      INTEGER,                              -- first rank it was seen on, NULL if none
    evidence  TEXT    NOT NULL,                     -- what the detector saw
    blamed    BOOLEAN NOT NULL,                     -- 1: the node is held responsible
    charged   BOOLEAN NOT NULL                      -- 1: counts against restart.max_restarts
);
CREATE INDEX failures_job ON failures (job_id, id);
CREATE INDEX failures_at ON failures (at_ms);

-- A cordoned node takes no new work: set by an operator (`ctl cordon`, lifted by `ctl uncordon`),
-- by a drain (`ctl drain`) or a preemption notice, or after repeated blamed failures (lifted by a
-- passing preflight); NULL columns when it is not cordoned.
ALTER TABLE agents ADD COLUMN cordon_by TEXT
    CHECK (cordon_by IN ('operator', 'failures', 'drain', 'preemption'));
ALTER TABLE agents ADD COLUMN cordon_reason TEXT;
ALTER TABLE agents ADD COLUMN cordoned_at_ms INTEGER;

-- Checkpoint receipts of a job, newest first: where a restarted attempt resumes from
-- (TRAINYARD_RESUME_STEP / TRAINYARD_RESUME_PATH). Partial, so step receipts do not pay for it.
CREATE INDEX receipts_checkpoints ON receipts (job_id, position) WHERE kind = 'checkpoint';
