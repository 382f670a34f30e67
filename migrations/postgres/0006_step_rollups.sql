-- Step receipts folded into buckets for the web view's plots (controller/src/series.rs): per
-- job, attempt, rank and bucket of `level` steps (16, 128 and 1024), the count, min, max and sum
-- of step time, loss, tokens/s and MFU. Built off the ingest path from receipts past the job's
-- watermark in step_rollup_progress, so every stored receipt is counted once.

CREATE TABLE step_rollups (
    job_id      BIGINT  NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt     BIGINT  NOT NULL,
    level       BIGINT  NOT NULL,   -- steps per bucket
    rank        BIGINT  NOT NULL,
    bucket      BIGINT  NOT NULL,   -- first step of the bucket / level
    step_ms_n   BIGINT  NOT NULL, step_ms_min DOUBLE PRECISION, step_ms_max DOUBLE PRECISION, step_ms_sum DOUBLE PRECISION,
    loss_n      BIGINT  NOT NULL, loss_min    DOUBLE PRECISION, loss_max    DOUBLE PRECISION, loss_sum    DOUBLE PRECISION,
    tps_n       BIGINT  NOT NULL, tps_min     DOUBLE PRECISION, tps_max     DOUBLE PRECISION, tps_sum     DOUBLE PRECISION,   -- tokens/s
    mfu_n       BIGINT  NOT NULL, mfu_min     DOUBLE PRECISION, mfu_max     DOUBLE PRECISION, mfu_sum     DOUBLE PRECISION,
    PRIMARY KEY (job_id, attempt, level, rank, bucket)
);

-- How far each job's receipts are folded: the highest receipts.position folded.
CREATE TABLE step_rollup_progress (
    job_id   BIGINT  PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
    position BIGINT  NOT NULL
);
