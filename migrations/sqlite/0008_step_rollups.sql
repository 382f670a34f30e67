-- Step receipts folded into buckets for the web view's plots (controller/src/series.rs): per
-- job, attempt, rank and bucket of `level` steps (16, 128 and 1024), the count, min, max and sum
-- of step time, loss, tokens/s and MFU. Built off the ingest path from receipts past the job's
-- watermark in step_rollup_progress, so every stored receipt is counted once.

CREATE TABLE step_rollups (
    job_id      INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt     INTEGER NOT NULL,
    level       INTEGER NOT NULL,   -- steps per bucket
    rank        INTEGER NOT NULL,
    bucket      INTEGER NOT NULL,   -- first step of the bucket / level
    step_ms_n   INTEGER NOT NULL, step_ms_min REAL, step_ms_max REAL, step_ms_sum REAL,
    loss_n      INTEGER NOT NULL, loss_min    REAL, loss_max    REAL, loss_sum    REAL,
    tps_n       INTEGER NOT NULL, tps_min     REAL, tps_max     REAL, tps_sum     REAL,   -- tokens/s
    mfu_n       INTEGER NOT NULL, mfu_min     REAL, mfu_max     REAL, mfu_sum     REAL,
    PRIMARY KEY (job_id, attempt, level, rank, bucket)
);

-- How far each job's receipts are folded: the highest receipts.position folded.
CREATE TABLE step_rollup_progress (
    job_id   INTEGER PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    position INTEGER NOT NULL
);
