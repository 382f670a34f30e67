-- Idempotent submits (see migrations/sqlite/0004_submit_key.sql): the client's key for the
-- submit that created the job, unique; NULL for submits without a key.
ALTER TABLE jobs ADD COLUMN submit_key TEXT;
CREATE UNIQUE INDEX jobs_submit_key ON jobs (submit_key) WHERE submit_key IS NOT NULL;
