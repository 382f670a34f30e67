//! One reading of one GPU, as a sampler gives it: plain data that the telemetry thread
//! summarises into windows and the metrics export under DCGM exporter's names.

/// One NVLink: (link number, up, cumulative CRC, replay and recovery errors).
pub type LinkReading = (u32, bool, [u64; 3]);

/// One reading of one GPU; `None` where the GPU does not support the query.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    pub gpu: u32,
    pub uuid: String,
    pub at_ms: i64,
    pub sm_clock_mhz: Option<f64>,
    pub mem_clock_mhz: Option<f64>,
    pub max_sm_clock_mhz: Option<f64>,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub gpu_temp_c: Option<f64>,
    pub mem_temp_c: Option<f64>,
    pub util_pct: Option<f64>,
    pub mem_used_bytes: Option<f64>,
    /// NVML clocks-event reason bits (`trainyard_proto::telemetry`).
    pub clock_reasons: u64,
    /// (generation, max generation, width, max width) of the PCIe link.
    pub pcie: Option<(u32, u32, u32, u32)>,
    /// (active, total) NVLinks.
    pub nvlinks: (u32, u32),
    /// Each NVLink the GPU has.
    pub links: Vec<LinkReading>,
    pub counters: Counters,
    pub remap_pending: bool,
    pub remap_failed: bool,
    /// XIDs the driver reported for this GPU since the previous reading.
    pub xids: Vec<u32>,
}

/// The counters a sample carries, cumulative since the driver loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub pcie_replays: u64,
    pub nvlink_crc: u64,
    pub nvlink_replay: u64,
    pub nvlink_recovery: u64,
    pub ecc_corrected: u64,
    pub ecc_uncorrected: u64,
}

impl Counters {
    /// `self - base` per counter; a counter below its base restarted from zero.
    pub fn since(&self, base: &Counters) -> Counters {
        let d = |now: u64, then: u64| if now >= then { now - then } else { now };
        Counters {
            pcie_replays: d(self.pcie_replays, base.pcie_replays),
            nvlink_crc: d(self.nvlink_crc, base.nvlink_crc),
            nvlink_replay: d(self.nvlink_replay, base.nvlink_replay),
            nvlink_recovery: d(self.nvlink_recovery, base.nvlink_recovery),
            ecc_corrected: d(self.ecc_corrected, base.ecc_corrected),
            ecc_uncorrected: d(self.ecc_uncorrected, base.ecc_uncorrected),
        }
    }

    /// `self + d` per counter.
    pub fn plus(&self, d: &Counters) -> Counters {
        Counters {
            pcie_replays: self.pcie_replays + d.pcie_replays,
            nvlink_crc: self.nvlink_crc + d.nvlink_crc,
            nvlink_replay: self.nvlink_replay + d.nvlink_replay,
            nvlink_recovery: self.nvlink_recovery + d.nvlink_recovery,
            ecc_corrected: self.ecc_corrected + d.ecc_corrected,
            ecc_uncorrected: self.ecc_uncorrected + d.ecc_uncorrected,
        }
    }
}
