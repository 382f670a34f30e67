-- Receipt schema v1 (docs/receipts.md): receipts that break it are stored but flagged, and the
-- typed fields of step receipts are columns of their own that the views and the diagnosis read.

-- Why a receipt does not follow schema v1 (wrong types, impossible values, an unknown schema
-- version); NULL when it does.
ALTER TABLE receipts ADD COLUMN problem TEXT;
-- Flagged receipts are few: a partial index makes counting a job's (`ctl status` does it for
-- every job it shows) cost the flagged rows, not all of the job's receipts.
CREATE INDEX receipts_flagged ON receipts (job_id, position) WHERE problem IS NOT NULL;

-- The typed fields of step receipts, in the receipt's own row (one insert per receipt keeps the
-- ingest rate): NULL for other kinds, and where a step receipt lacked the field or carried it
-- with a wrong type or an impossible value.
ALTER TABLE receipts ADD COLUMN step_time_ms                REAL;              -- wall time of the whole step
ALTER TABLE receipts ADD COLUMN fwd_bwd_ms                  REAL;              -- forward and backward passes
ALTER TABLE receipts ADD COLUMN optimizer_ms                REAL;              -- optimizer step, collectives included
ALTER TABLE receipts ADD COLUMN optimizer_reduce_ms         REAL;              -- its gradient reduce(-scatter) phase
ALTER TABLE receipts ADD COLUMN optimizer_compute_gather_ms REAL;              -- its update and all-gather phase
ALTER TABLE receipts ADD COLUMN optimizer_wait_ms           REAL;              -- its wait for outstanding collectives
ALTER TABLE receipts ADD COLUMN tokens_per_s                REAL;              -- training tokens per second (this rank's view of the job)
ALTER TABLE receipts ADD COLUMN mfu                         REAL;              -- model FLOPs utilisation, fraction of the dense bf16 peak
ALTER TABLE receipts ADD COLUMN loss                        REAL;              -- training loss
ALTER TABLE receipts ADD COLUMN mem_allocated_bytes         INTEGER;           -- allocator: bytes allocated
ALTER TABLE receipts ADD COLUMN mem_reserved_bytes          INTEGER;           -- allocator: bytes reserved (fragmentation = reserved - allocated)
ALTER TABLE receipts ADD COLUMN mem_peak_allocated_bytes    INTEGER;           -- allocator: peak allocated during the step

-- Step receipts with their typed fields, the way the diagnosis and operators read them.
CREATE VIEW step_metrics AS
SELECT job_id, attempt, rank, seq, step,
       step_time_ms, fwd_bwd_ms, optimizer_ms, optimizer_reduce_ms, optimizer_compute_gather_ms,
       optimizer_wait_ms, tokens_per_s, mfu, loss,
       mem_allocated_bytes, mem_reserved_bytes, mem_peak_allocated_bytes, stored_at_ms
FROM receipts
WHERE kind = 'step';

-- Step time and throughput of every job, over all its step receipts (all attempts and ranks).
DROP VIEW step_time_summary;
CREATE VIEW step_time_summary AS
SELECT r.job_id               AS job_id,
       j.name                 AS job_name,
       count(*)               AS step_receipts,
       avg(r.step_time_ms)    AS mean_step_time_ms,
       min(r.step_time_ms)    AS min_step_time_ms,
       max(r.step_time_ms)    AS max_step_time_ms,
       avg(r.tokens_per_s)    AS mean_tokens_per_s
FROM receipts r
JOIN jobs j ON j.id = r.job_id
WHERE r.kind = 'step'
GROUP BY r.job_id;

-- Receipts that break schema v1, counted per job, with the position of the newest (look its
-- `problem` up in receipts).
CREATE VIEW receipt_problems AS
SELECT job_id, count(*) AS flagged, max(position) AS last_position
FROM receipts WHERE problem IS NOT NULL
GROUP BY job_id;
