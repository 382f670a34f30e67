-- trainyard controller store, SQLite flavour. docs/schema.md explains every table for operators.
-- Times are integer milliseconds since the Unix epoch (UTC). States are lower-case words.
-- PostgreSQL gets its own folder (migrations/postgres) with the same tables and columns.

-- One row per submitted job.
CREATE TABLE jobs (
    id            INTEGER PRIMARY KEY AUTOINCREMENT, -- job id shown by `ctl`; never reused, even after a delete
    name          TEXT    NOT NULL,                  -- spec: name
    state         TEXT    NOT NULL                   -- current state, a cache of the newest job_events row
                  CHECK (state IN ('pending', 'scheduled', 'launching', 'running', 'restarting',
                                   'succeeded', 'failed', 'cancelled')),
    reason        TEXT    NOT NULL,                  -- reason of the last transition
    attempt       INTEGER NOT NULL,                  -- current attempt (0 = first run; +1 per restart)
    priority      INTEGER NOT NULL,                  -- spec: priority (higher runs first)
    gpus          INTEGER NOT NULL,                  -- spec: total GPUs (= ranks)
    gpus_per_node INTEGER NOT NULL,                  -- spec: GPUs per node, 0 = scheduler's choice
    engine_kind   TEXT                               -- 'exec' or 'builtin' (NULL: spec without engine)
                  CHECK (engine_kind IN ('exec', 'builtin')),
    argv_json     TEXT,                              -- exec engine: argv as a JSON array of strings
    workdir       TEXT,                              -- exec engine: working directory of every rank
    spec_pb       BLOB    NOT NULL,                  -- the full JobSpec, protobuf-encoded (source of truth)
    created_at_ms INTEGER NOT NULL,                  -- when the job was submitted
    updated_at_ms INTEGER NOT NULL                   -- when the state last changed
);
CREATE INDEX jobs_state ON jobs (state);

-- Every state transition of every job, oldest first by id.
CREATE TABLE job_events (
    id         INTEGER PRIMARY KEY,                  -- monotonic; orders the events
    job_id     INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    at_ms      INTEGER NOT NULL,                     -- when the transition happened
    from_state TEXT,                                 -- NULL for the event that created the job
    to_state   TEXT    NOT NULL,                     -- state entered
    attempt    INTEGER NOT NULL,                     -- the job's attempt after the transition
    reason     TEXT    NOT NULL                      -- why (human-readable)
);
CREATE INDEX job_events_job ON job_events (job_id, id);

-- Where every rank of every attempt runs (intent, written by the scheduler) and what its agent
-- last reported about it (observed).
CREATE TABLE allocations (
    job_id        INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt       INTEGER NOT NULL,                  -- attempt this placement belongs to
    rank          INTEGER NOT NULL,                  -- global rank (RANK)
    agent_id      TEXT    NOT NULL,                  -- host running it (agents.agent_id; no foreign key so
                                                     -- decommissioned hosts can be deleted, history stays)
    gpu_index     INTEGER NOT NULL,                  -- GPU index in the host's numbering
    node_rank     INTEGER NOT NULL,                  -- NODE_RANK
    local_rank    INTEGER NOT NULL,                  -- LOCAL_RANK
    state         TEXT    NOT NULL,                  -- 'planned', then 'launching', 'running', 'exited' or 'lost'
    pid           INTEGER,                           -- process id on the host, once running
    exit_code     INTEGER,                           -- exit code, once exited normally
    signal        INTEGER,                           -- signal number, if killed by one
    message       TEXT    NOT NULL,                  -- agent's last message about the rank ('' if none)
    skipped_lines INTEGER NOT NULL,                  -- receipt lines the agent could not parse
    updated_at_ms INTEGER NOT NULL,                  -- when the agent last reported (or the plan was written)
    PRIMARY KEY (job_id, attempt, rank)
);
CREATE INDEX allocations_agent ON allocations (agent_id);

-- Every host that ever said hello.
CREATE TABLE agents (
    agent_id      TEXT    PRIMARY KEY,               -- agent's id (default: hostname)
    hostname      TEXT    NOT NULL,                  -- inventory: hostname
    address       TEXT    NOT NULL,                  -- address other hosts dial (MASTER_ADDR)
    agent_version TEXT    NOT NULL,                  -- trainyard-agent version string
    state         TEXT    NOT NULL                   -- 'connected', 'disconnected' or 'leaving'
                  CHECK (state IN ('connected', 'disconnected', 'leaving')),
    gpu_count     INTEGER NOT NULL,                  -- number of GPUs in the inventory
    inventory_pb  BLOB    NOT NULL,                  -- full HostInventory, protobuf-encoded
    first_seen_ms INTEGER NOT NULL,                  -- first hello ever
    last_seen_ms  INTEGER NOT NULL                   -- last hello, heartbeat or state change
);

-- The GPUs of every agent, flattened from its inventory (rewritten at every hello).
CREATE TABLE gpus (
    agent_id   TEXT    NOT NULL REFERENCES agents (agent_id) ON DELETE CASCADE,
    gpu_index  INTEGER NOT NULL,                     -- index in the host's numbering (nvidia-smi order)
    uuid       TEXT    NOT NULL,                     -- GPU-xxxxxxxx-...
    model      TEXT    NOT NULL,                     -- e.g. 'NVIDIA H100 80GB HBM3'
    memory_mib INTEGER NOT NULL,                     -- total memory in MiB
    pci_bus_id TEXT    NOT NULL,                     -- e.g. '00000000:18:00.0'
    numa_node  INTEGER NOT NULL,                     -- NUMA node the GPU hangs off (-1: unknown)
    PRIMARY KEY (agent_id, gpu_index)
);
CREATE INDEX gpus_uuid ON gpus (uuid);

-- Every receipt line every rank wrote, stored once: a replayed receipt hits the UNIQUE key and is
-- skipped. No foreign key to jobs on purpose: this is the hot path (100k rows/s), and the service
-- checks the job before it stores a batch.
CREATE TABLE receipts (
    position     INTEGER PRIMARY KEY,                -- monotonic over the whole store; `ctl watch` cursor
    job_id       INTEGER NOT NULL,                   -- jobs.id
    attempt      INTEGER NOT NULL,                   -- attempt of the rank that wrote it
    rank         INTEGER NOT NULL,                   -- rank that wrote it
    seq          INTEGER NOT NULL,                   -- line number in the rank's receipts file (from 0)
    kind         TEXT    NOT NULL,                   -- 'launch', 'step', 'eval', 'checkpoint', 'exit', 'goodput', ...
    step         INTEGER,                            -- the receipt's "step" field, if it had one
    body         TEXT    NOT NULL,                   -- the JSON line as the rank wrote it
    stored_at_ms INTEGER NOT NULL,                   -- when the controller stored it
    UNIQUE (job_id, attempt, rank, seq)
);
CREATE INDEX receipts_job_position ON receipts (job_id, position);

-- Progress of every rank of the current attempt of every job: one row per allocation, with
-- the ranks that have not written anything yet at receipt_count 0.
CREATE VIEW job_progress AS
SELECT a.job_id                    AS job_id,
       j.name                      AS job_name,
       j.state                     AS job_state,
       a.attempt                   AS attempt,
       a.rank                      AS rank,
       a.agent_id                  AS agent_id,
       a.gpu_index                 AS gpu_index,
       a.state                     AS rank_state,
       max(r.step)                 AS last_step,
       max(r.seq)                  AS last_seq,
       count(r.position)           AS receipt_count,
       max(r.stored_at_ms)         AS last_receipt_at_ms
FROM jobs j
JOIN allocations a ON a.job_id = j.id AND a.attempt = j.attempt
LEFT JOIN receipts r ON r.job_id = a.job_id AND r.attempt = a.attempt AND r.rank = a.rank
GROUP BY a.job_id, a.attempt, a.rank;

-- Step time and throughput of every job, over all its step receipts (all attempts and ranks).
CREATE VIEW step_time_summary AS
SELECT r.job_id                                        AS job_id,
       j.name                                          AS job_name,
       count(*)                                        AS step_receipts,
       avg(json_extract(r.body, '$.step_time_ms'))     AS mean_step_time_ms,
       min(json_extract(r.body, '$.step_time_ms'))     AS min_step_time_ms,
       max(json_extract(r.body, '$.step_time_ms'))     AS max_step_time_ms,
       avg(json_extract(r.body, '$.tokens_per_s'))     AS mean_tokens_per_s
FROM receipts r
JOIN jobs j ON j.id = r.job_id
WHERE r.kind = 'step'
GROUP BY r.job_id;
