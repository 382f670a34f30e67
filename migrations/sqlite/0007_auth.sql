-- Who may do what: users with their hashed API tokens, the owner of every job, and the audit
-- log of control actions. See docs/security.md.

CREATE TABLE users (
    name           TEXT    PRIMARY KEY,          -- what `ctl` shows and jobs.submitted_by holds
    admin          BOOLEAN NOT NULL DEFAULT 0,   -- 1: sees and cancels every job, runs preflight
    unix_user      TEXT,                         -- the account ranks run as; NULL: cannot submit
    created_at_ms  INTEGER NOT NULL,
    disabled_at_ms INTEGER                       -- set: every token of the user is refused
);

CREATE TABLE api_tokens (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    user_name     TEXT    NOT NULL REFERENCES users (name) ON DELETE CASCADE,
    token_sha256  TEXT    NOT NULL UNIQUE,       -- hex SHA-256 of the token; the token itself is never stored
    prefix        TEXT    NOT NULL,              -- the token's first characters, to tell tokens apart
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER,                       -- NULL: no expiry
    revoked_at_ms INTEGER                        -- set: refused from then on
);
CREATE INDEX api_tokens_by_user ON api_tokens (user_name);

-- Every accepted and refused control action: submit, cancel, preflight runs, user and token
-- changes, and calls refused for want of a credential or a permission.
CREATE TABLE audit_log (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms   INTEGER NOT NULL,
    actor   TEXT    NOT NULL,   -- user name; '-' when no valid credential came with the call
    action  TEXT    NOT NULL,   -- e.g. job.submit, job.cancel, node.preflight, user.add, token.revoke
    target  TEXT    NOT NULL,   -- e.g. job:42, node:sxm-a, user:alice
    outcome TEXT    NOT NULL,   -- accepted | refused
    detail  TEXT    NOT NULL    -- why it was refused, or what was changed
);
CREATE INDEX audit_log_by_time ON audit_log (at_ms);

-- The job's owner: the user who submitted it, and the Unix account its ranks run as.
ALTER TABLE jobs ADD COLUMN submitted_by TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN run_as TEXT NOT NULL DEFAULT '';
CREATE INDEX jobs_by_submitter ON jobs (submitted_by);
