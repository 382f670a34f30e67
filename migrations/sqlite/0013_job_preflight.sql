-- A job's launch preflight is the job's report, never the node's verdict (docs/security.md):
-- job_id names the job (NULL for a preflight of the whole node), gpus the GPUs it checked
-- (comma-separated NVML indices; '' for the whole node). The node's latest report is the newest
-- with job_id NULL.
ALTER TABLE preflight_reports ADD COLUMN job_id INTEGER;
ALTER TABLE preflight_reports ADD COLUMN gpus TEXT NOT NULL DEFAULT '';
