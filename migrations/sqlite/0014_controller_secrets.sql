-- Values a controller group shares and keeps for the life of its database, created on first
-- use by the leader: `cluster_id` (a random id in every run directory's name, so that a job id
-- repeated by a restored database or another controller never meets an old job's files) and
-- `env_hash_key` (the key of the keyed hash that launch receipts carry instead of `[env]`
-- values: docs/security.md).
CREATE TABLE controller_secrets (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL
);
