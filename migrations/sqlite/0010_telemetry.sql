-- GPU telemetry (docs/telemetry.md): one row per GPU per window, as the agent summarised it:
-- gauges as mean/max (the SM clock also min), throttle reasons OR-ed (NVML's bits), counters as
-- deltas over the window, and the rank that used the GPU with the steps it ran in the window.
-- Kept for --telemetry-retention-days (30); a resent batch is ignored by the unique key.
CREATE TABLE gpu_samples (
    id              INTEGER PRIMARY KEY,            -- monotonic; live diagnosis reads after it
    agent_id        TEXT    NOT NULL,               -- host (agents.agent_id)
    gpu             INTEGER NOT NULL,               -- GPU index on the host
    uuid            TEXT    NOT NULL,               -- GPU UUID ('' if unknown)
    start_ms        INTEGER NOT NULL,               -- first reading of the window
    end_ms          INTEGER NOT NULL,               -- when the window closed
    samples         INTEGER NOT NULL,               -- readings in the window
    sm_clock_min    REAL,                           -- MHz
    sm_clock_mean   REAL,
    sm_clock_max    REAL,
    sm_clock_limit  REAL    NOT NULL,               -- the GPU's maximum SM clock, MHz (0: unknown)
    mem_clock_mean  REAL,                           -- MHz
    power_mean      REAL,                           -- W
    power_max       REAL,
    power_limit     REAL    NOT NULL,               -- enforced power limit, W (0: unknown)
    gpu_temp_mean   REAL,                           -- C
    gpu_temp_max    REAL,
    mem_temp_max    REAL,                           -- HBM, C
    util_mean       REAL,                           -- %
    mem_used_max    REAL,                           -- bytes
    clock_reasons   INTEGER NOT NULL,               -- NVML clocks-event reason bits, OR-ed
    pcie_gen        INTEGER NOT NULL,               -- lowest link generation seen (0: unknown)
    pcie_gen_max    INTEGER NOT NULL,
    pcie_width      INTEGER NOT NULL,               -- lowest link width seen (0: unknown)
    pcie_width_max  INTEGER NOT NULL,
    pcie_replays    INTEGER NOT NULL,               -- PCIe replays in the window
    nvlinks_up      INTEGER NOT NULL,               -- active NVLinks at the window's end
    nvlinks_total   INTEGER NOT NULL,
    nvlink_crc_errors      INTEGER NOT NULL,        -- in the window
    nvlink_replay_errors   INTEGER NOT NULL,
    nvlink_recovery_errors INTEGER NOT NULL,
    ecc_corrected   INTEGER NOT NULL,               -- volatile ECC errors in the window
    ecc_uncorrected INTEGER NOT NULL,
    remap_pending   BOOLEAN NOT NULL,               -- a row remapping waits for a GPU reset
    remap_failed    BOOLEAN NOT NULL,
    xids            TEXT    NOT NULL,               -- XIDs in the window, comma-separated ('' none)
    nvlink_detail   TEXT    NOT NULL,               -- links down or erring: 'link 3 down; link 7: 12 crc' ('' none)
    job_id          INTEGER,                        -- the rank on the GPU (NULL: idle)
    attempt         INTEGER,
    rank            INTEGER,
    first_step      INTEGER,                        -- steps it ran in the window (NULL: none)
    last_step       INTEGER,
    UNIQUE (agent_id, gpu, start_ms)
);
-- "This job's GPUs over this step range", and the live diagnosis's new windows of a job.
CREATE INDEX gpu_samples_job ON gpu_samples (job_id, attempt, rank, first_step);
CREATE INDEX gpu_samples_job_id ON gpu_samples (job_id, id);
-- A node's telemetry plots, and retention.
CREATE INDEX gpu_samples_agent ON gpu_samples (agent_id, start_ms);
CREATE INDEX gpu_samples_end ON gpu_samples (end_ms);

-- Findings of the live diagnosis (docs/diagnosis.md): opened when first seen, updated while they
-- last, closed when they stop. One open row per (job, cause, subject); the alert columns record
-- which webhook messages went out, so a restarted controller neither repeats nor loses one.
CREATE TABLE live_findings (
    id               INTEGER PRIMARY KEY,
    job_id           INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt          INTEGER NOT NULL,
    cause            TEXT    NOT NULL,              -- a diagnosis cause word (gpu.thermal_throttle, ...)
    subject          TEXT    NOT NULL,              -- what it is about: node[/gpu] or the ranks
    nodes            TEXT    NOT NULL,              -- comma-separated agent ids
    ranks            TEXT    NOT NULL,              -- comma-separated ranks
    summary          TEXT    NOT NULL,
    evidence         TEXT    NOT NULL,              -- the measures, "name=value unit; ..."
    remedy           TEXT    NOT NULL,
    first_step       INTEGER,                       -- the job's newest step when it opened (plots draw a band)
    last_step        INTEGER,                       -- the job's newest step when it was last seen
    opened_at_ms     INTEGER NOT NULL,
    updated_at_ms    INTEGER NOT NULL,
    closed_at_ms     INTEGER,                       -- NULL while it lasts
    alerted_open_ms  INTEGER,                       -- when the opening alert was delivered
    alerted_close_ms INTEGER                        -- when the closing alert was delivered
);
CREATE UNIQUE INDEX live_findings_open ON live_findings (job_id, cause, subject) WHERE closed_at_ms IS NULL;
CREATE INDEX live_findings_job ON live_findings (job_id, id);

-- A new failure kind: an XID that asks for a GPU reset or a reboot, on a GPU of the attempt.
-- SQLite cannot alter a CHECK: the table is rebuilt with its rows.
CREATE TABLE failures_new (
    id        INTEGER PRIMARY KEY,
    job_id    INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt   INTEGER NOT NULL,
    at_ms     INTEGER NOT NULL,
    kind      TEXT    NOT NULL
              CHECK (kind IN ('rank_exit', 'host_lost', 'rank_lost', 'preflight', 'hang',
                             'preemption', 'drain', 'preempted', 'gpu_xid')),
    agent_id  TEXT,
    rank      INTEGER,
    evidence  TEXT    NOT NULL,
    blamed    BOOLEAN NOT NULL,
    charged   BOOLEAN NOT NULL
);
INSERT INTO failures_new SELECT id, job_id, attempt, at_ms, kind, agent_id, rank, evidence, blamed, charged FROM failures;
DROP TABLE failures;
ALTER TABLE failures_new RENAME TO failures;
CREATE INDEX failures_job ON failures (job_id, id);
CREATE INDEX failures_at ON failures (at_ms);
