-- Preflight: what each agent found when it checked its node. docs/schema.md explains both tables.
-- A node whose newest report has verdict 'fail' is not scheduled; `ctl nodes` says why from here.

-- One row per preflight report an agent sent (with its hello, after a re-run, or on request).
CREATE TABLE preflight_reports (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT, -- report id shown by `ctl nodes`; grows with every report
    agent_id           TEXT    NOT NULL,                  -- host that ran it (agents.agent_id; no foreign key so
                                                          -- decommissioned hosts can be deleted, history stays)
    local_id           TEXT    NOT NULL,                  -- agent-assigned '<agent_id>-<started_at_ms>', what ranks see in
                                                          -- TRAINYARD_PREFLIGHT_REPORT ('' if the agent gave none)
    level              TEXT    NOT NULL,                  -- 'quick', 'standard' or 'full'
    started_at_ms      INTEGER NOT NULL,                  -- when the agent started the checks
    finished_at_ms     INTEGER NOT NULL,                  -- when it finished them
    verdict            TEXT    NOT NULL                   -- worst status of the checks ('skipped' counts as pass)
                       CHECK (verdict IN ('pass', 'warn', 'fail')),
    interconnect_class TEXT    NOT NULL,                  -- 'nvswitch', 'nvlink-pairs', 'pcie', 'mixed' ('' if unknown)
    driver_version     TEXT    NOT NULL,                  -- NVIDIA driver, e.g. '570.124.06' ('' if not found)
    cuda_version       TEXT    NOT NULL,                  -- CUDA driver API version, e.g. '12.8' ('' if not found)
    nccl_version       TEXT    NOT NULL,                  -- NCCL library version, e.g. '2.28.3' ('' if not found)
    source             TEXT    NOT NULL,                  -- where the inventory came from: 'nvml' or 'host-file'
    topology           TEXT    NOT NULL,                  -- the GPU matrix as `nvidia-smi topo -m` prints it
    received_at_ms     INTEGER NOT NULL                   -- when the controller stored it
);
CREATE INDEX preflight_reports_agent ON preflight_reports (agent_id, id);
-- An agent that sends the same report again (its hello after a reconnect) gets the stored row.
CREATE UNIQUE INDEX preflight_reports_local_id ON preflight_reports (agent_id, local_id) WHERE local_id <> '';

-- The checks of every report, one row each, in the order the agent ran them.
CREATE TABLE preflight_checks (
    report_id INTEGER NOT NULL REFERENCES preflight_reports (id) ON DELETE CASCADE,
    position  INTEGER NOT NULL,                           -- order within the report (from 0)
    check_id  TEXT    NOT NULL,                           -- stable id, e.g. 'numa.split', 'host.shm', 'cuda.init.gpu3'
    status    TEXT    NOT NULL                            -- outcome of this check
              CHECK (status IN ('pass', 'warn', 'fail', 'skipped')),
    measured  TEXT    NOT NULL,                           -- what the agent found, e.g. '4+4 GPUs over 2 NUMA nodes'
    expected  TEXT    NOT NULL,                           -- what a healthy node shows
    remedy    TEXT    NOT NULL,                           -- what an operator should do ('' when it passed)
    PRIMARY KEY (report_id, position)
);
CREATE INDEX preflight_checks_failing ON preflight_checks (check_id, status);
