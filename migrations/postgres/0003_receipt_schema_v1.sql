-- Receipt schema v1 (docs/receipts.md), as migrations/sqlite/0005_receipt_schema_v1.sql: receipts that break it are stored but flagged, and the
-- typed fields of step receipts get a table of their own that the views and the diagnosis read.

-- Why a receipt does not follow schema v1 (wrong types, impossible values, an unknown schema
-- version); NULL when it does.
ALTER TABLE receipts ADD COLUMN problem TEXT;

-- The typed fields of every step receipt, one row per receipt (same key as `receipts`). A field
-- the receipt lacked, or carried with a wrong type or an impossible value, is NULL.
CREATE TABLE step_metrics (
    job_id                      BIGINT NOT NULL,  -- jobs.id
    attempt                     BIGINT NOT NULL,  -- attempt of the rank
    rank                        BIGINT NOT NULL,  -- rank that wrote it
    seq                         BIGINT NOT NULL,  -- receipts.seq of the step receipt
    step                        BIGINT,           -- training step
    step_time_ms                DOUBLE PRECISION, -- wall time of the whole step
    fwd_bwd_ms                  DOUBLE PRECISION, -- forward and backward passes
    optimizer_ms                DOUBLE PRECISION, -- optimizer step, collectives included
    optimizer_reduce_ms         DOUBLE PRECISION, -- its gradient reduce(-scatter) phase
    optimizer_compute_gather_ms DOUBLE PRECISION, -- its update and all-gather phase
    optimizer_wait_ms           DOUBLE PRECISION, -- its wait for outstanding collectives
    tokens_per_s                DOUBLE PRECISION, -- training tokens per second (this rank's view of the job)
    mfu                         DOUBLE PRECISION, -- model FLOPs utilisation, fraction of the dense bf16 peak
    loss                        DOUBLE PRECISION, -- training loss
    mem_allocated_bytes         BIGINT,           -- allocator: bytes allocated
    mem_reserved_bytes          BIGINT,           -- allocator: bytes reserved (fragmentation = reserved - allocated)
    mem_peak_allocated_bytes    BIGINT,           -- allocator: peak allocated during the step
    stored_at_ms                BIGINT NOT NULL,  -- when the controller stored it
    PRIMARY KEY (job_id, attempt, rank, seq)
);
CREATE INDEX step_metrics_job_step ON step_metrics (job_id, step);

-- Step time and throughput of every job, over all its step receipts (all attempts and ranks).
DROP VIEW step_time_summary;
CREATE VIEW step_time_summary AS
SELECT m.job_id               AS job_id,
       j.name                 AS job_name,
       count(*)               AS step_receipts,
       avg(m.step_time_ms)    AS mean_step_time_ms,
       min(m.step_time_ms)    AS min_step_time_ms,
       max(m.step_time_ms)    AS max_step_time_ms,
       avg(m.tokens_per_s)    AS mean_tokens_per_s
FROM step_metrics m
JOIN jobs j ON j.id = m.job_id
GROUP BY m.job_id, j.name;

-- Receipts that break schema v1, counted per job, with the position of the newest (look its
-- `problem` up in receipts).
CREATE VIEW receipt_problems AS
SELECT job_id, count(*) AS flagged, max(position) AS last_position
FROM receipts WHERE problem IS NOT NULL
GROUP BY job_id;
