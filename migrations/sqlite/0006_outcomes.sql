-- What the controller concluded about a job when it ended: where the wall time of each attempt
-- went (goodput) and the diagnosis findings, stragglers included, with their evidence.
-- Written once every rank of the final attempt has stopped; `ctl status` and `ctl diagnose`
-- compute the same live for running jobs.

CREATE TABLE attempt_goodput (
    job_id         INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt        INTEGER NOT NULL,
    wall_ms        REAL    NOT NULL,   -- placement to restart or end
    startup_ms     REAL    NOT NULL,   -- placement to the end of the first step, less that step
    train_ms       REAL    NOT NULL,   -- sum of rank 0's step times (lost included)
    eval_ms        REAL    NOT NULL,   -- sum of eval receipts' duration_ms
    checkpoint_ms  REAL    NOT NULL,   -- sum of checkpoint receipts' duration_ms
    restart_ms     REAL    NOT NULL,   -- the previous attempt's end to this one's placement
    lost_ms        REAL    NOT NULL,   -- time spent redoing steps an earlier attempt had done
    steps_redone   INTEGER NOT NULL,
    other_ms       REAL    NOT NULL,   -- the rest: stalls, waits, time without receipts
    recorded_at_ms INTEGER NOT NULL,
    PRIMARY KEY (job_id, attempt)
);

-- Per job: the attempts and the restarts between them, and goodput = (train - lost) / wall.
CREATE VIEW job_goodput AS
SELECT job_id,
       count(*)                          AS attempts,
       sum(wall_ms + restart_ms)         AS wall_ms,
       sum(startup_ms)                   AS startup_ms,
       sum(train_ms)                     AS train_ms,
       sum(eval_ms)                      AS eval_ms,
       sum(checkpoint_ms)                AS checkpoint_ms,
       sum(restart_ms)                   AS restart_ms,
       sum(lost_ms)                      AS lost_ms,
       sum(steps_redone)                 AS steps_redone,
       sum(other_ms)                     AS other_ms,
       (sum(train_ms) - sum(lost_ms)) / nullif(sum(wall_ms + restart_ms), 0) AS goodput
FROM attempt_goodput
GROUP BY job_id;

CREATE TABLE job_findings (
    job_id         INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt        INTEGER NOT NULL,
    position       INTEGER NOT NULL,   -- 0 = the likeliest cause
    cause          TEXT    NOT NULL,   -- stable id: numa.split, shm.disabled, straggler.unexplained, ...
    summary        TEXT    NOT NULL,
    nodes          TEXT    NOT NULL,   -- JSON array of agent ids
    ranks          TEXT    NOT NULL,   -- JSON array of ranks
    evidence       TEXT    NOT NULL,   -- JSON array of {name, value, unit}
    remedy         TEXT    NOT NULL,
    recorded_at_ms INTEGER NOT NULL,
    PRIMARY KEY (job_id, attempt, position)
);
