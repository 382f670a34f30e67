-- trainyard controller store, PostgreSQL flavour: the same tables, columns, views and meaning as
-- migrations/sqlite (0001_init, 0002_preflight and 0003_pinning there), in one file because this
-- backend started after them. docs/schema.md explains every table for operators.
-- Times are BIGINT milliseconds since the Unix epoch (UTC). States are lower-case words. Every
-- integer column is BIGINT, so the same client code reads both backends with one integer type.

-- One row per submitted job.
CREATE TABLE jobs (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, -- job id shown by `ctl`; never reused
    name          TEXT   NOT NULL,                  -- spec: name
    state         TEXT   NOT NULL                   -- current state, a cache of the newest job_events row
                  CHECK (state IN ('pending', 'scheduled', 'launching', 'running', 'restarting',
                                   'succeeded', 'failed', 'cancelled')),
    reason        TEXT   NOT NULL,                  -- reason of the last transition
    attempt       BIGINT NOT NULL,                  -- current attempt (0 = first run; +1 per restart)
    priority      BIGINT NOT NULL,                  -- spec: priority (higher runs first)
    gpus          BIGINT NOT NULL,                  -- spec: total GPUs (= ranks)
    gpus_per_node BIGINT NOT NULL,                  -- spec: GPUs per node, 0 = scheduler's choice
    engine_kind   TEXT                              -- 'exec' or 'builtin' (NULL: spec without engine)
                  CHECK (engine_kind IN ('exec', 'builtin')),
    argv_json     TEXT,                             -- exec engine: argv as a JSON array of strings
    workdir       TEXT,                             -- exec engine: working directory of every rank
    spec_pb       BYTEA  NOT NULL,                  -- the full JobSpec, protobuf-encoded (source of truth)
    created_at_ms BIGINT NOT NULL,                  -- when the job was submitted
    updated_at_ms BIGINT NOT NULL                   -- when the state last changed
);
CREATE INDEX jobs_state ON jobs (state);

-- Every state transition of every job, oldest first by id.
CREATE TABLE job_events (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, -- monotonic; orders the events
    job_id     BIGINT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    at_ms      BIGINT NOT NULL,                     -- when the transition happened
    from_state TEXT,                                -- NULL for the event that created the job
    to_state   TEXT   NOT NULL,                     -- state entered
    attempt    BIGINT NOT NULL,                     -- the job's attempt after the transition
    reason     TEXT   NOT NULL                      -- why (human-readable)
);
CREATE INDEX job_events_job ON job_events (job_id, id);

-- Where every rank of every attempt runs (intent) and what its agent last reported (observed).
CREATE TABLE allocations (
    job_id         BIGINT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt        BIGINT NOT NULL,                 -- attempt this placement belongs to
    rank           BIGINT NOT NULL,                 -- global rank (RANK)
    agent_id       TEXT   NOT NULL,                 -- host running it (agents.agent_id; no foreign key)
    gpu_index      BIGINT NOT NULL,                 -- GPU index in the host's numbering
    node_rank      BIGINT NOT NULL,                 -- NODE_RANK
    local_rank     BIGINT NOT NULL,                 -- LOCAL_RANK
    state          TEXT   NOT NULL,                 -- 'planned', then 'launching', 'running', 'exited' or 'lost'
    pid            BIGINT,                          -- process id on the host, once running
    exit_code      BIGINT,                          -- exit code, once exited normally
    signal         BIGINT,                          -- signal number, if killed by one
    message        TEXT   NOT NULL,                 -- agent's last message about the rank ('' if none)
    skipped_lines  BIGINT NOT NULL,                 -- receipt lines the agent could not parse
    updated_at_ms  BIGINT NOT NULL,                 -- when the agent last reported (or the plan was written)
    planned_cpus   TEXT   NOT NULL DEFAULT '',      -- CPUs the rank is bound to ('0-15,64-79'; '' = unpinned)
    planned_mems   TEXT   NOT NULL DEFAULT '',      -- NUMA memory node(s) it is bound to
    effective_cpus TEXT   NOT NULL DEFAULT '',      -- Cpus_allowed_list of the live rank ('' = not read yet)
    effective_mems TEXT   NOT NULL DEFAULT '',      -- Mems_allowed_list of the live rank (or why binding failed)
    PRIMARY KEY (job_id, attempt, rank)
);
CREATE INDEX allocations_agent ON allocations (agent_id);

-- Every host that ever said hello.
CREATE TABLE agents (
    agent_id      TEXT   PRIMARY KEY,               -- agent's id (default: hostname)
    hostname      TEXT   NOT NULL,                  -- inventory: hostname
    address       TEXT   NOT NULL,                  -- address other hosts dial (MASTER_ADDR)
    agent_version TEXT   NOT NULL,                  -- trainyard-agent version string
    state         TEXT   NOT NULL                   -- 'connected', 'disconnected' or 'leaving'
                  CHECK (state IN ('connected', 'disconnected', 'leaving')),
    gpu_count     BIGINT NOT NULL,                  -- number of GPUs in the inventory
    inventory_pb  BYTEA  NOT NULL,                  -- full HostInventory, protobuf-encoded
    first_seen_ms BIGINT NOT NULL,                  -- first hello ever
    last_seen_ms  BIGINT NOT NULL                   -- last hello, heartbeat or state change
);

-- The GPUs of every agent, flattened from its inventory (rewritten at every hello).
CREATE TABLE gpus (
    agent_id   TEXT   NOT NULL REFERENCES agents (agent_id) ON DELETE CASCADE,
    gpu_index  BIGINT NOT NULL,                     -- index in the host's numbering (nvidia-smi order)
    uuid       TEXT   NOT NULL,                     -- GPU-xxxxxxxx-...
    model      TEXT   NOT NULL,                     -- e.g. 'NVIDIA H100 80GB HBM3'
    memory_mib BIGINT NOT NULL,                     -- total memory in MiB
    pci_bus_id TEXT   NOT NULL,                     -- e.g. '00000000:18:00.0'
    numa_node  BIGINT NOT NULL,                     -- NUMA node the GPU hangs off (-1: unknown)
    PRIMARY KEY (agent_id, gpu_index)
);
CREATE INDEX gpus_uuid ON gpus (uuid);

-- Every receipt line every rank wrote, stored once: a replayed receipt hits the UNIQUE key and is
-- skipped. Writers serialise on a transaction-level advisory lock, so positions become visible in
-- order and a `ctl watch` cursor never steps over a row committed late.
CREATE TABLE receipts (
    position     BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, -- monotonic over the store; watch cursor
    job_id       BIGINT NOT NULL,                   -- jobs.id
    attempt      BIGINT NOT NULL,                   -- attempt of the rank that wrote it
    rank         BIGINT NOT NULL,                   -- rank that wrote it
    seq          BIGINT NOT NULL,                   -- line number in the rank's receipts file (from 0)
    kind         TEXT   NOT NULL,                   -- 'launch', 'step', 'eval', 'checkpoint', 'exit', 'goodput', ...
    step         BIGINT,                            -- the receipt's "step" field, if it had one
    body         TEXT   NOT NULL,                   -- the JSON line as the rank wrote it
    stored_at_ms BIGINT NOT NULL,                   -- when the controller stored it
    UNIQUE (job_id, attempt, rank, seq)
);
CREATE INDEX receipts_job_position ON receipts (job_id, position);

-- Preflight: one row per report an agent sent (with its hello, after a re-run, or on request).
CREATE TABLE preflight_reports (
    id                 BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, -- report id shown by `ctl nodes`
    agent_id           TEXT   NOT NULL,             -- host that ran it (agents.agent_id; no foreign key)
    local_id           TEXT   NOT NULL,             -- agent-assigned '<agent_id>-<started_at_ms>' ('' if none)
    level              TEXT   NOT NULL,             -- 'quick', 'standard' or 'full'
    started_at_ms      BIGINT NOT NULL,             -- when the agent started the checks
    finished_at_ms     BIGINT NOT NULL,             -- when it finished them
    verdict            TEXT   NOT NULL              -- worst status of the checks ('skipped' counts as pass)
                       CHECK (verdict IN ('pass', 'warn', 'fail')),
    interconnect_class TEXT   NOT NULL,             -- 'nvswitch', 'nvlink-pairs', 'pcie', 'mixed' ('' if unknown)
    driver_version     TEXT   NOT NULL,             -- NVIDIA driver ('' if not found)
    cuda_version       TEXT   NOT NULL,             -- CUDA driver API version ('' if not found)
    nccl_version       TEXT   NOT NULL,             -- NCCL library version ('' if not found)
    source             TEXT   NOT NULL,             -- where the inventory came from: 'nvml' or 'host-file'
    topology           TEXT   NOT NULL,             -- the GPU matrix as `nvidia-smi topo -m` prints it
    received_at_ms     BIGINT NOT NULL              -- when the controller stored it
);
CREATE INDEX preflight_reports_agent ON preflight_reports (agent_id, id);
CREATE UNIQUE INDEX preflight_reports_local_id ON preflight_reports (agent_id, local_id) WHERE local_id <> '';

-- The checks of every report, one row each, in the order the agent ran them.
CREATE TABLE preflight_checks (
    report_id BIGINT NOT NULL REFERENCES preflight_reports (id) ON DELETE CASCADE,
    position  BIGINT NOT NULL,                      -- order within the report (from 0)
    check_id  TEXT   NOT NULL,                      -- stable id, e.g. 'numa.split', 'host.shm'
    status    TEXT   NOT NULL                       -- outcome of this check
              CHECK (status IN ('pass', 'warn', 'fail', 'skipped')),
    measured  TEXT   NOT NULL,                      -- what the agent found
    expected  TEXT   NOT NULL,                      -- what a healthy node shows
    remedy    TEXT   NOT NULL,                      -- what an operator should do ('' when it passed)
    PRIMARY KEY (report_id, position)
);
CREATE INDEX preflight_checks_failing ON preflight_checks (check_id, status);

-- A number field of a receipt body, or NULL when the body lacks it or it is not a number. The
-- controller stores only bodies that are JSON objects, so the cast cannot fail. PostgreSQL's JSON
-- functions refuse the escape \u0000, which valid JSON may hold in a string: such a body has
-- no numbers here (it is still stored whole).
CREATE FUNCTION receipt_number(body TEXT, field TEXT) RETURNS DOUBLE PRECISION
LANGUAGE SQL IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE WHEN strpos(body, '\u0000') > 0 THEN NULL
                WHEN json_typeof(body::json -> field) = 'number' THEN (body::json ->> field)::DOUBLE PRECISION
           END
$$;

-- Progress of every rank of the current attempt of every job (see migrations/sqlite).
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
GROUP BY j.id, a.job_id, a.attempt, a.rank;

-- Step time and throughput of every job, over all its step receipts (all attempts and ranks).
CREATE VIEW step_time_summary AS
SELECT r.job_id                                        AS job_id,
       j.name                                          AS job_name,
       count(*)                                        AS step_receipts,
       avg(receipt_number(r.body, 'step_time_ms'))     AS mean_step_time_ms,
       min(receipt_number(r.body, 'step_time_ms'))     AS min_step_time_ms,
       max(receipt_number(r.body, 'step_time_ms'))     AS max_step_time_ms,
       avg(receipt_number(r.body, 'tokens_per_s'))     AS mean_tokens_per_s
FROM receipts r
JOIN jobs j ON j.id = r.job_id
WHERE r.kind = 'step'
GROUP BY r.job_id, j.name;
