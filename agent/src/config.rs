//! The agent's settings, as a plain struct: the binary fills it from its flags, tests fill it
//! by hand. No clap here, so the library never depends on how it is invoked.

use std::path::PathBuf;
use std::time::Duration;

/// The shim's own binary, looked for beside the agent's ([`AgentConfig::new`]).
pub const SHIM_BINARY: &str = "trainyard-shim";

/// `trainyard-shim` beside the agent's executable `me` where it is, else `me` (whose `supervise`
/// is the same shim, in a binary ten times the size).
pub fn shim_beside(me: PathBuf) -> PathBuf {
    let beside = me.with_file_name(SHIM_BINARY);
    if beside.is_file() { beside } else { me }
}

/// Everything the agent daemon needs to run.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Controller URL, e.g. `http://127.0.0.1:7070`.
    pub controller: String,
    /// JSON host-description file standing in for NVML; `None` discovers the GPUs through
    /// NVML (a real GPU host).
    pub host_file: Option<PathBuf>,
    /// Root of `runs/` and `state/`.
    pub data_dir: PathBuf,
    /// Identity in the fleet; `None` means the hostname of the inventory.
    pub agent_id: Option<String>,
    /// What other hosts dial for `MASTER_ADDR` when this host holds rank 0; `None`: the local
    /// address of the connection to the controller ([`crate::address::detect`]).
    pub address: Option<String>,
    /// Program run as `PROGRAM supervise ...` for every rank: `trainyard-shim` beside the
    /// daemon's executable, else that executable; tests pass a built binary.
    pub shim_program: PathBuf,
    /// How often the connection reads receipts and checks ranks.
    pub tick: Duration,
    /// Heartbeat period on the stream.
    pub heartbeat: Duration,
    /// Receipts per batch, at most (never above [`trainyard_proto::limits::MAX_RECEIPT_BATCH`]).
    pub max_batch_receipts: usize,
    /// Bytes of receipt bodies per batch, at most (a single longer line still goes alone).
    pub max_batch_bytes: usize,
    /// Batches sent but not yet acknowledged, at most; beyond it the agent stops reading.
    pub max_unacked_batches: usize,
    /// CPUs kept for the agent (the lowest-numbered ones): left out of the NUMA CPU lists the
    /// controller plans rank pinning from. Default 0.
    pub reserve_cpus: u32,
    /// Where to serve `/metrics` and `/healthz`; `None` serves no HTTP.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Write the bound metrics address here once listening (port 0 in tests).
    pub metrics_addr_file: Option<PathBuf>,
    /// TLS towards the controller: the CA that signed its certificate, and this agent's
    /// client certificate (whose common name is the agent id) and key. `None`: plaintext.
    pub tls: Option<TlsFiles>,
    /// When the agent runs as root, run launches that name no Unix account (the loopback
    /// demo's) as root instead of refusing them. For a single-user development box only.
    pub allow_root_ranks: bool,
    /// Hold each rank's processes with its shim as a child subreaper even where cgroups can
    /// be made (`--process-tracking subreaper`); by default, cgroups where the host allows.
    pub subreaper_only: bool,
    /// What is kept of each of a rank's streams, in bytes (`--rank-output-cap-mib`).
    pub rank_output_cap: u64,
    /// The interpreters the Python bootstrap is compiled with (a name is looked up on `PATH`).
    pub bootstrap_pythons: Vec<PathBuf>,
    /// No launch and no rank output while the data directory is under this
    /// (`--disk-floor-mib`, `--disk-floor-percent`).
    pub disk_floor: crate::layout::DiskFloor,
    /// Where preemption notices come from (`crate::notice`), how often it is polled, and how
    /// long the host has once one comes (30 s, GCP's; AWS gives 120 s).
    pub preemption_notice: Option<crate::notice::NoticeSource>,
    pub notice_poll: Duration,
    pub notice_deadline: Duration,
    /// Where GPU telemetry comes from (`crate::telemetry`), how often each GPU is read, and how
    /// long a summarised window is.
    pub telemetry: GpuSource,
    /// Where a launch learns which processes compute on a GPU.
    pub gpu_processes: GpuSource,
    pub telemetry_every: Duration,
    pub telemetry_window: Duration,
    /// Inside a Slurm allocation (`--slurm-job`): the job it joined for and its token.
    pub slurm: Option<crate::slurm::SlurmAgent>,
}

/// Where the agent reads a GPU fact from (its telemetry, the processes computing on it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSource {
    /// NVML when the host has a driver; otherwise none, logged with the reason.
    Auto,
    /// Not read.
    Off,
    /// A file standing in for the driver (hosts without a GPU: tests, demos).
    Script(PathBuf),
}

impl GpuSource {
    /// `auto`, `off` or `script:FILE`, as given to the flag `--{flag}`.
    pub fn parse(flag: &str, text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Off),
            _ => match text.strip_prefix("script:") {
                Some(path) if !path.is_empty() => Ok(Self::Script(PathBuf::from(path))),
                _ => Err(format!("--{flag} {text:?}: give auto, off or script:FILE")),
            },
        }
    }
}

/// The PEM files of an agent's TLS (`trainyard-controller init-pki` writes them as
/// `agents/NAME/{ca.pem,agent.pem,agent.key}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// `ca.pem`, `agent.pem` and `agent.key` in `dir`.
    pub fn in_dir(dir: &std::path::Path) -> Self {
        TlsFiles { ca: dir.join("ca.pem"), cert: dir.join("agent.pem"), key: dir.join("agent.key") }
    }
}

impl AgentConfig {
    /// Settings with the documented defaults; the shim is `trainyard-shim` beside this process's
    /// executable, or this executable itself (its `supervise`) where there is none.
    pub fn new(controller: impl Into<String>, host_file: Option<PathBuf>, data_dir: PathBuf) -> Self {
        let shim_program = shim_beside(std::env::current_exe().unwrap_or_else(|_| "trainyard-agent".into()));
        Self {
            controller: controller.into(),
            host_file,
            data_dir,
            agent_id: None,
            address: None,
            shim_program,
            tick: Duration::from_millis(50),
            heartbeat: Duration::from_secs(2),
            max_batch_receipts: 2000,
            max_batch_bytes: 1 << 20,
            max_unacked_batches: 8,
            reserve_cpus: 0,
            metrics_listen: None,
            metrics_addr_file: None,
            tls: None,
            allow_root_ranks: false,
            subreaper_only: false,
            rank_output_cap: crate::output::DEFAULT_CAP_BYTES,
            bootstrap_pythons: vec!["python3".into()],
            disk_floor: crate::layout::DiskFloor::default(),
            preemption_notice: None,
            notice_poll: Duration::from_secs(1),
            notice_deadline: Duration::from_secs(30),
            telemetry: GpuSource::Auto,
            gpu_processes: GpuSource::Auto,
            telemetry_every: Duration::from_secs(1),
            telemetry_window: Duration::from_secs(10),
            slurm: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shim_is_the_small_binary_beside_the_agent_where_there_is_one() {
        let dir = tempfile::tempdir().unwrap();
        let agent = dir.path().join("trainyard-agent");
        std::fs::write(&agent, b"").unwrap();
        assert_eq!(shim_beside(agent.clone()), agent, "no shim beside: the agent's own supervise");
        std::fs::create_dir(dir.path().join(SHIM_BINARY)).unwrap();
        assert_eq!(shim_beside(agent.clone()), agent, "a directory of that name is no binary");
        std::fs::remove_dir(dir.path().join(SHIM_BINARY)).unwrap();
        std::fs::write(dir.path().join(SHIM_BINARY), b"").unwrap();
        assert_eq!(shim_beside(agent), dir.path().join(SHIM_BINARY));
    }
}
