//! The agent's Prometheus metrics, served on `/metrics` of `--metrics-listen` (OpenMetrics text
//! through `prometheus-client`), with `/healthz`.
//!
//! | metric | type | what |
//! |---|---|---|
//! | `trainyard_agent_ranks{phase}` | gauge | ranks this agent holds, by phase (launching, running, exited, lost) |
//! | `trainyard_agent_connected` | gauge | 1 while the stream to the controller is open |
//! | `trainyard_agent_receipt_lag_bytes` | gauge | bytes of receipts files written by ranks but not yet acknowledged by the controller |
//! | `trainyard_agent_unacked_batches` | gauge | receipt batches sent and not yet acknowledged |
//! | `trainyard_agent_skipped_lines` | gauge | lines of the held ranks' receipts files that are not receipts |
//! | `trainyard_agent_receipts_relayed_total` | counter | receipts sent to the controller (resends after a reconnect included) |
//! | `trainyard_agent_receipt_bytes_relayed_total` | counter | their bytes |
//! | `trainyard_agent_telemetry_pending_windows` | gauge | GPU telemetry windows not yet acknowledged |
//! | `trainyard_agent_telemetry_dropped_windows_total` | counter | windows dropped because the queue was full (the controller away for hours) |
//! | `DCGM_FI_DEV_*{gpu,UUID,job,attempt,rank}` | gauge | each GPU of a running rank, at every telemetry reading, under DCGM exporter's names ([`DCGM`]) |
//!
//! The agent gauges are refreshed from the connection loop about once a second; the GPU gauges
//! by the telemetry thread at each reading. A GPU's series are removed when its rank stops.

use std::sync::OnceLock;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::gpu_sample::Sample;
use crate::launcher::Launcher;
use crate::layout::RankId;
use trainyard_proto::words::RankState;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    pub phase: &'static str,
}

/// The labels of a GPU series: DCGM exporter's `gpu` and `UUID`, plus the rank using the GPU
/// (`job`, `attempt`, `rank`). A list, because DCGM's `UUID` is not a Rust field name.
pub type GpuLabels = Vec<(&'static str, String)>;

type GpuGauge = Family<GpuLabels, Gauge<f64, std::sync::atomic::AtomicU64>>;

/// A DCGM exporter field this agent exports: its name, its help, and how a reading gives it.
pub struct DcgmField {
    pub name: &'static str,
    pub help: &'static str,
    pub read: fn(&Sample) -> Option<f64>,
}

/// The DCGM exporter fields, under their names, so existing GPU dashboards read them.
pub const DCGM: &[DcgmField] = &[
    DcgmField {
        name: "DCGM_FI_DEV_SM_CLOCK",
        help: "SM clock frequency (in MHz).",
        read: |s| s.sm_clock_mhz,
    },
    DcgmField {
        name: "DCGM_FI_DEV_MEM_CLOCK",
        help: "Memory clock frequency (in MHz).",
        read: |s| s.mem_clock_mhz,
    },
    DcgmField { name: "DCGM_FI_DEV_GPU_TEMP", help: "GPU temperature (in C).", read: |s| s.gpu_temp_c },
    DcgmField { name: "DCGM_FI_DEV_MEMORY_TEMP", help: "Memory temperature (in C).", read: |s| s.mem_temp_c },
    DcgmField { name: "DCGM_FI_DEV_POWER_USAGE", help: "Power draw (in W).", read: |s| s.power_w },
    DcgmField {
        name: "DCGM_FI_DEV_POWER_MGMT_LIMIT",
        help: "Enforced power limit (in W).",
        read: |s| s.power_limit_w,
    },
    DcgmField { name: "DCGM_FI_DEV_GPU_UTIL", help: "GPU utilization (in %).", read: |s| s.util_pct },
    DcgmField {
        name: "DCGM_FI_DEV_FB_USED",
        help: "Framebuffer memory used (in MiB).",
        read: |s| s.mem_used_bytes.map(|b| b / 1048576.0),
    },
    DcgmField {
        name: "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        help: "Current clock throttle reasons (NVML bitmask).",
        read: |s| Some(s.clock_reasons as f64),
    },
    DcgmField {
        name: "DCGM_FI_DEV_PCIE_LINK_GEN",
        help: "PCIe link generation.",
        read: |s| s.pcie.map(|p| f64::from(p.0)),
    },
    DcgmField {
        name: "DCGM_FI_DEV_PCIE_LINK_WIDTH",
        help: "PCIe link width.",
        read: |s| s.pcie.map(|p| f64::from(p.2)),
    },
    DcgmField {
        name: "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        help: "Total number of PCIe retries.",
        read: |s| Some(s.counters.pcie_replays as f64),
    },
    DcgmField {
        name: "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        help: "Total number of NVLink flow-control CRC errors.",
        read: |s| Some(s.counters.nvlink_crc as f64),
    },
    DcgmField {
        name: "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        help: "Total number of NVLink retries.",
        read: |s| Some(s.counters.nvlink_replay as f64),
    },
    DcgmField {
        name: "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        help: "Total number of NVLink recovery errors.",
        read: |s| Some(s.counters.nvlink_recovery as f64),
    },
    DcgmField {
        name: "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        help: "Total number of single-bit volatile ECC errors.",
        read: |s| Some(s.counters.ecc_corrected as f64),
    },
    DcgmField {
        name: "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        help: "Total number of double-bit volatile ECC errors.",
        read: |s| Some(s.counters.ecc_uncorrected as f64),
    },
    DcgmField {
        name: "DCGM_FI_DEV_ROW_REMAP_PENDING",
        help: "Row remapping is pending (a GPU reset applies it).",
        read: |s| Some(f64::from(u8::from(s.remap_pending))),
    },
    DcgmField {
        name: "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        help: "Whether remapping of rows has failed.",
        read: |s| Some(f64::from(u8::from(s.remap_failed))),
    },
    DcgmField {
        name: "DCGM_FI_DEV_XID_ERRORS",
        help: "Value of the last XID error encountered.",
        read: |s| s.xids.last().map(|x| f64::from(*x)),
    },
];

pub struct Metrics {
    registry: Registry,
    pub ranks: Family<PhaseLabel, Gauge>,
    pub connected: Gauge,
    /// Streams opened to a controller (HelloAck received).
    pub connects: Counter,
    /// Followers of a controller group that named their leader, which the agent then dialed.
    pub redirects: Counter,
    pub receipt_lag_bytes: Gauge,
    pub unacked_batches: Gauge,
    pub skipped_lines: Gauge,
    pub held_ranks: Gauge,
    pub receipts_relayed: Counter,
    pub receipt_bytes_relayed: Counter,
    pub telemetry_pending: Gauge,
    pub telemetry_dropped: Counter,
    /// One family per [`DCGM`] field, in its order.
    gpu: Vec<GpuGauge>,
    /// The labels each GPU's series carry now.
    gpu_labels: std::sync::Mutex<std::collections::BTreeMap<u32, GpuLabels>>,
}

/// The process's metrics, registered on first use.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

impl Metrics {
    fn new() -> Metrics {
        let mut root = Registry::default();
        let gpu: Vec<GpuGauge> = DCGM.iter().map(|_| GpuGauge::default()).collect();
        for (field, family) in DCGM.iter().zip(&gpu) {
            root.register(field.name, field.help, family.clone());
        }
        let registry = root.sub_registry_with_prefix("trainyard_agent");
        let m = Metrics {
            registry: Registry::default(),
            ranks: Family::default(),
            connected: Gauge::default(),
            connects: Counter::default(),
            redirects: Counter::default(),
            receipt_lag_bytes: Gauge::default(),
            unacked_batches: Gauge::default(),
            skipped_lines: Gauge::default(),
            held_ranks: Gauge::default(),
            receipts_relayed: Counter::default(),
            receipt_bytes_relayed: Counter::default(),
            telemetry_pending: Gauge::default(),
            telemetry_dropped: Counter::default(),
            gpu,
            gpu_labels: Default::default(),
        };
        registry.register("ranks", "Ranks this agent holds, by phase", m.ranks.clone());
        registry.register("connected", "1 while the stream to the controller is open", m.connected.clone());
        registry.register(
            "connects",
            "Streams opened to a controller (hello acknowledged)",
            m.connects.clone(),
        );
        registry.register(
            "controller_redirects",
            "Times a follower of the controller group named its leader and the agent dialed it",
            m.redirects.clone(),
        );
        registry.register(
            "receipt_lag_bytes",
            "Bytes of receipts files not yet acknowledged by the controller",
            m.receipt_lag_bytes.clone(),
        );
        registry.register(
            "unacked_batches",
            "Receipt batches awaiting acknowledgement",
            m.unacked_batches.clone(),
        );
        registry.register(
            "skipped_lines",
            "Receipts-file lines that are not receipts",
            m.skipped_lines.clone(),
        );
        registry.register(
            "held_ranks",
            "Ranks whose receipts the controller does not acknowledge (it does not know the job): kept in their files, not read further",
            m.held_ranks.clone(),
        );
        registry.register("receipts_relayed", "Receipts sent to the controller", m.receipts_relayed.clone());
        registry.register("receipt_bytes_relayed", "Bytes of receipts sent", m.receipt_bytes_relayed.clone());
        registry.register(
            "telemetry_pending_windows",
            "GPU telemetry windows not yet acknowledged by the controller",
            m.telemetry_pending.clone(),
        );
        registry.register(
            "telemetry_dropped_windows",
            "GPU telemetry windows dropped because the queue was full",
            m.telemetry_dropped.clone(),
        );
        Metrics { registry: root, ..m }
    }

    /// Sets GPU `sample.gpu`'s series from a reading, labelled with the rank using it.
    pub fn observe_gpu(&self, sample: &Sample, rank: RankId) {
        let labels: GpuLabels = vec![
            ("gpu", sample.gpu.to_string()),
            ("UUID", sample.uuid.clone()),
            ("job", rank.job_id.to_string()),
            ("attempt", rank.attempt.to_string()),
            ("rank", rank.rank.to_string()),
        ];
        let mut current = self.gpu_labels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = current.insert(sample.gpu, labels.clone()).filter(|old| *old != labels) {
            self.gpu.iter().for_each(|f| {
                f.remove(&old);
            });
        }
        for (field, family) in DCGM.iter().zip(&self.gpu) {
            match (field.read)(sample) {
                Some(v) => {
                    family.get_or_create(&labels).set(v);
                }
                None => {
                    family.remove(&labels);
                }
            }
        }
    }

    /// Removes GPU `gpu`'s series (its rank stopped).
    pub fn forget_gpu(&self, gpu: u32) {
        let mut current = self.gpu_labels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = current.remove(&gpu) {
            self.gpu.iter().for_each(|f| {
                f.remove(&old);
            });
        }
    }

    /// Sets the gauges from the ranks the launcher holds.
    pub fn observe(&self, launcher: &Launcher, unacked_batches: usize) {
        for phase in [RankState::Launching, RankState::Running, RankState::Exited, RankState::Lost] {
            let n = launcher.ranks().filter(|r| r.record.phase == phase).count();
            self.ranks.get_or_create(&PhaseLabel { phase: phase.as_str() }).set(n as i64);
        }
        let lag: u64 = launcher
            .ranks()
            .map(|r| {
                let written = std::fs::metadata(r.tailer.path()).map_or(0, |m| m.len());
                written.saturating_sub(r.tailer.acked().offset)
            })
            .sum();
        self.receipt_lag_bytes.set(i64::try_from(lag).unwrap_or(i64::MAX));
        self.unacked_batches.set(unacked_batches as i64);
        let skipped: u64 = launcher.ranks().map(|r| r.tailer.skipped_lines()).sum();
        self.skipped_lines.set(i64::try_from(skipped).unwrap_or(i64::MAX));
        self.held_ranks.set(launcher.ranks().filter(|r| r.tailer.held()).count() as i64);
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// `/metrics` and `/healthz`; anything else is a 404 that says what is served.
pub fn router() -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
                    metrics().encode(),
                )
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .fallback(|uri: axum::http::Uri| async move {
            (
                StatusCode::NOT_FOUND,
                format!("no page {}; this listener serves /metrics and /healthz\n", uri.path()),
            )
        })
}
