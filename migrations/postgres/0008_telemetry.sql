-- GPU telemetry (docs/telemetry.md): one row per GPU per window, as the agent summarised it:
-- gauges as mean/max (the SM clock also min), throttle reasons OR-ed (NVML's bits), counters as
-- deltas over the window, and the rank that used the GPU with the steps it ran in the window.
-- Kept for --telemetry-retention-days (30); a resent batch is ignored by the unique key.
CREATE TABLE gpu_samples (
    id              BIGSERIAL PRIMARY KEY,          -- monotonic; live diagnosis reads after it
    agent_id        TEXT    NOT NULL,               -- host (agents.agent_id)
    gpu             BIGINT  NOT NULL,               -- GPU index on the host
    uuid            TEXT    NOT NULL,               -- GPU UUID ('' if unknown)
    start_ms        BIGINT  NOT NULL,               -- first reading of the window
    end_ms          BIGINT  NOT NULL,               -- when the window closed
    samples         BIGINT  NOT NULL,               -- readings in the window
    sm_clock_min    DOUBLE PRECISION,                           -- MHz
    sm_clock_mean   DOUBLE PRECISION,
    sm_clock_max    DOUBLE PRECISION,
    sm_clock_limit  DOUBLE PRECISION    NOT NULL,               -- the GPU's maximum SM clock, MHz (0: unknown)
    mem_clock_mean  DOUBLE PRECISION,                           -- MHz
    power_mean      DOUBLE PRECISION,                           -- W
    power_max       DOUBLE PRECISION,
    power_limit     DOUBLE PRECISION    NOT NULL,               -- enforced power limit, W (0: unknown)
    gpu_temp_mean   DOUBLE PRECISION,                           -- C
    gpu_temp_max    DOUBLE PRECISION,
    mem_temp_max    DOUBLE PRECISION,                           -- HBM, C
    util_mean       DOUBLE PRECISION,                           -- %
    mem_used_max    DOUBLE PRECISION,                           -- bytes
    clock_reasons   BIGINT  NOT NULL,               -- NVML clocks-event reason bits, OR-ed
    pcie_gen        BIGINT  NOT NULL,               -- lowest link generation seen (0: unknown)
    pcie_gen_max    BIGINT  NOT NULL,
    pcie_width      BIGINT  NOT NULL,               -- lowest link width seen (0: unknown)
    pcie_width_max  BIGINT  NOT NULL,
    pcie_replays    BIGINT  NOT NULL,               -- PCIe replays in the window
    nvlinks_up      BIGINT  NOT NULL,               -- active NVLinks at the window's end
    nvlinks_total   BIGINT  NOT NULL,
    nvlink_crc_errors      BIGINT  NOT NULL,        -- in the window
    nvlink_replay_errors   BIGINT  NOT NULL,
    nvlink_recovery_errors BIGINT  NOT NULL,
    ecc_corrected   BIGINT  NOT NULL,               -- volatile ECC errors in the window
    ecc_uncorrected BIGINT  NOT NULL,
    remap_pending   BOOLEAN NOT NULL,               -- a row remapping waits for a GPU reset
    remap_failed    BOOLEAN NOT NULL,
    xids            TEXT    NOT NULL,               -- XIDs in the window, comma-separated ('' none)
    nvlink_detail   TEXT    NOT NULL,               -- links down or erring: 'link 3 down; link 7: 12 crc' ('' none)
    job_id          BIGINT ,                        -- the rank on the GPU (NULL: idle)
    attempt         BIGINT ,
    rank            BIGINT ,
    first_step      BIGINT ,                        -- steps it ran in the window (NULL: none)
    last_step       BIGINT ,
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
    id               BIGSERIAL PRIMARY KEY,
    job_id           BIGINT  NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt          BIGINT  NOT NULL,
    cause            TEXT    NOT NULL,              -- a diagnosis cause word (gpu.thermal_throttle, ...)
    subject          TEXT    NOT NULL,              -- what it is about: node[/gpu] or the ranks
    nodes            TEXT    NOT NULL,              -- comma-separated agent ids
    ranks            TEXT    NOT NULL,              -- comma-separated ranks
    summary          TEXT    NOT NULL,
    evidence         TEXT    NOT NULL,              -- the measures, "name=value unit; ..."
    remedy           TEXT    NOT NULL,
    first_step       BIGINT ,                       -- the job's newest step when it opened (plots draw a band)
    last_step        BIGINT ,                       -- the job's newest step when it was last seen
    opened_at_ms     BIGINT  NOT NULL,
    updated_at_ms    BIGINT  NOT NULL,
    closed_at_ms     BIGINT ,                       -- NULL while it lasts
    alerted_open_ms  BIGINT ,                       -- when the opening alert was delivered
    alerted_close_ms BIGINT                         -- when the closing alert was delivered
);
CREATE UNIQUE INDEX live_findings_open ON live_findings (job_id, cause, subject) WHERE closed_at_ms IS NULL;
CREATE INDEX live_findings_job ON live_findings (job_id, id);

-- A new failure kind: an XID that asks for a GPU reset or a reboot, on a GPU of the attempt.
ALTER TABLE failures DROP CONSTRAINT failures_kind_check;
ALTER TABLE failures ADD CONSTRAINT failures_kind_check
    CHECK (kind IN ('rank_exit', 'host_lost', 'rank_lost', 'preflight', 'hang',
                    'preemption', 'drain', 'preempted', 'gpu_xid'));
