-- Idempotent submits: the key a client sent with `Submit` (ctl makes one per invocation and
-- resends it when it retries), so a retried submit returns the job the first one created
-- instead of creating a second. NULL for submits without a key.
ALTER TABLE jobs ADD COLUMN submit_key TEXT;
CREATE UNIQUE INDEX jobs_submit_key ON jobs (submit_key) WHERE submit_key IS NOT NULL;
