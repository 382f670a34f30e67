//! `trainyard-agent`: the host agent daemon, and (`supervise`) the per-rank shim it runs.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use trainyard_agent::AgentConfig;
use trainyard_agent::config::{GpuSource, TlsFiles};
use trainyard_proto::words::Verdict;

mod shim;

#[derive(Debug, Parser)]
#[command(name = "trainyard-agent", version, about = "trainyard's host agent")]
struct Cli {
    /// Controller URL, or several separated by commas (a controller group: the agent dials them
    /// in turn and stays with the one that leads).
    #[arg(long, env = "TRAINYARD_CONTROLLER", global = true)]
    controller: Option<String>,
    /// JSON host-description file standing in for NVML; without it the agent describes this
    /// host through NVML (a real GPU host).
    #[arg(long, global = true)]
    host_file: Option<PathBuf>,
    /// Directory for run directories and the agent's state.
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    /// Identity in the fleet (default: the hostname of the host description).
    #[arg(long, global = true)]
    agent_id: Option<String>,
    /// Address other hosts dial for MASTER_ADDR (default: the local address of this host's
    /// connection to the controller, detected at every connect).
    #[arg(long, global = true)]
    address: Option<String>,
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    /// CPUs kept for the agent: the lowest-numbered N CPUs never get a rank pinned to them.
    #[arg(long, default_value_t = 0, global = true)]
    reserve_cpus: u32,
    /// Serve /metrics (Prometheus) and /healthz on this address, e.g. 127.0.0.1:7072; port 0
    /// picks a free port (see --metrics-addr-file). Default: no HTTP.
    #[arg(long, global = true)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Allow --metrics-listen on a non-loopback address (a monitoring network): the agent's
    /// /metrics has no authentication, so without this flag it stays on loopback.
    #[arg(long, global = true)]
    metrics_public: bool,
    /// Write the bound metrics address here once listening.
    #[arg(long, global = true)]
    metrics_addr_file: Option<PathBuf>,
    /// Dial the controller over TLS with the files `trainyard-controller init-pki` (or
    /// `issue-agent-cert`) wrote for this agent: ca.pem, agent.pem, agent.key. The
    /// certificate's name must be this agent's id.
    #[arg(long, env = "TRAINYARD_TLS_DIR", global = true)]
    tls_dir: Option<PathBuf>,
    /// The CA of the controller's certificate, overriding --tls-dir's ca.pem.
    #[arg(long, global = true)]
    tls_ca: Option<PathBuf>,
    /// This agent's client certificate, overriding --tls-dir's agent.pem.
    #[arg(long, global = true, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// This agent's key, overriding --tls-dir's agent.key.
    #[arg(long, global = true, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// When this agent runs as root, run ranks of jobs that name no Unix account (the loopback
    /// demo's) as root instead of refusing them. A single-user development box only.
    #[arg(long, env = "TRAINYARD_ALLOW_ROOT_RANKS", global = true)]
    allow_root_ranks: bool,
    /// How every process of a rank is held: `auto` (a cgroup per rank where this host lets
    /// the agent make one, else its shim as a child subreaper) or `subreaper`.
    #[arg(long, env = "TRAINYARD_PROCESS_TRACKING", value_enum, default_value_t = ProcessTracking::Auto, global = true)]
    process_tracking: ProcessTracking,
    /// MiB kept of each of a rank's streams (stdout, stderr): past half of it the log is rotated
    /// to `<name>.1`, the oldest output dropped and counted.
    #[arg(long, env = "TRAINYARD_RANK_OUTPUT_CAP_MIB", default_value_t = 512, global = true, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    rank_output_cap_mib: u64,
    /// A Python that ranks run under, to compile the bootstrap with once (so that each rank's
    /// interpreter need not); repeat for several versions (docs/receipts.md).
    #[arg(
        long,
        env = "TRAINYARD_BOOTSTRAP_PYTHON",
        value_delimiter = ',',
        default_value = "python3",
        global = true
    )]
    bootstrap_python: Vec<PathBuf>,
    /// No launch and no rank output while the data directory's file system has less free than
    /// the larger of this many MiB and --disk-floor-percent of its size.
    #[arg(long, env = "TRAINYARD_DISK_FLOOR_MIB", default_value_t = 1024, global = true)]
    disk_floor_mib: u64,
    /// The disk floor's share of the data directory's file system, in percent (0 to 50).
    #[arg(long, env = "TRAINYARD_DISK_FLOOR_PERCENT", default_value_t = 5, global = true,
          value_parser = clap::value_parser!(u8).range(0..=50))]
    disk_floor_percent: u8,
    /// Where this host's preemption notice appears: file:PATH (a file a cloud metadata handler
    /// writes), http://HOST:PORT/PATH (a local endpoint, polled) or cmd:PROGRAM ARGS (run at
    /// every poll; output means a notice). The jobs here then checkpoint and move.
    #[arg(long, env = "TRAINYARD_PREEMPTION_NOTICE", global = true)]
    preemption_notice: Option<String>,
    /// Seconds the host has once a notice comes (GCP gives 30, AWS spot 120).
    #[arg(long, default_value_t = 30, global = true)]
    preemption_deadline_secs: u64,
    /// GPU telemetry: auto (NVML when the host has a driver, else skipped), off, or
    /// script:FILE (a scripted sampler replaying FILE, for hosts without a GPU; docs/telemetry.md).
    #[arg(long, env = "TRAINYARD_TELEMETRY", default_value = "auto", global = true)]
    telemetry: String,
    /// Which processes compute on a GPU, checked before a rank starts on it: auto (NVML when
    /// the host has a driver, else the ranks' cgroups alone), off, or script:FILE (a JSON file
    /// of {"GPU index": [pids]}, for hosts without a GPU; docs/security.md).
    #[arg(long, env = "TRAINYARD_GPU_PROCESSES", default_value = "auto", global = true)]
    gpu_processes: String,
    /// Seconds between two readings of each GPU of a running rank.
    #[arg(long, env = "TRAINYARD_TELEMETRY_EVERY_SECS", default_value_t = 1.0, global = true)]
    telemetry_every_secs: f64,
    /// Seconds of readings summarised into one window (min/mean/max, reasons OR-ed, counters as deltas).
    #[arg(long, env = "TRAINYARD_TELEMETRY_WINDOW_SECS", default_value_t = 10.0, global = true)]
    telemetry_window_secs: f64,
    /// Run inside a Slurm allocation for this trainyard job (the batch script `ctl submit
    /// --slurm` writes starts one agent per node so): join with the job's token
    /// (TRAINYARD_JOIN_TOKEN), take its ranks alone, exit when it ends (docs/slurm.md).
    #[arg(long, global = true)]
    slurm_job: Option<u64>,
    /// The join token of --slurm-job's job.
    #[arg(long, env = "TRAINYARD_JOIN_TOKEN", hide_env_values = true, global = true)]
    join_token: Option<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check this node (topology, NUMA, host, NVML, CUDA, NCCL) and print the report. Uses
    /// --host-file when given, NVML otherwise. Exit code: 0 pass or warn, 1 fail, 2 when the
    /// preflight cannot run (no host file and no NVML, bad arguments).
    Preflight {
        /// quick (inventory, topology, host, CUDA), standard (+ NCCL to 256 MiB), full (+ 1 GiB).
        #[arg(long, default_value = "quick")]
        level: String,
        /// text (the matrix, then one row per check) or json.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Say what a GPU topology means for training: reads the text of `nvidia-smi topo -m`
    /// (FILE, or - for standard input) as operators paste it. Without FILE: this host's matrix
    /// from NVML (or --host-file), compared cell for cell with `nvidia-smi topo -m` when that
    /// command exists. Exit code: 0; 1 when NVML and nvidia-smi disagree; 2 when the text or
    /// the host cannot be read.
    Topo {
        /// A saved `nvidia-smi topo -m` output, or - for standard input.
        file: Option<PathBuf>,
    },
    /// Read this host's GPUs as the telemetry thread does and print every reading (clocks and
    /// their event reasons, power, temperatures, utilisation, memory, PCIe, NVLink, ECC, row
    /// remaps, XIDs): one line per GPU every --telemetry-every-secs. Uses --telemetry (NVML by
    /// default). Read-only: it never changes a GPU setting. Exit code 2 when nothing can be read.
    Telemetry {
        /// GPU indexes to read, comma-separated (default: every GPU NVML lists).
        #[arg(long, value_delimiter = ',')]
        gpus: Vec<u32>,
        /// Readings to take of each GPU.
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// text (one line per reading) or json (one object per line, nvidia-smi's field names).
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Internal: the NCCL sweep's child process; prints its outcome as one JSON line.
    #[command(hide = true)]
    NcclSweep {
        #[arg(long)]
        gpus: usize,
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<u64>,
    },
    /// Internal: the per-rank shim the agent starts for every rank.
    #[command(hide = true)]
    Supervise(Box<shim::ShimCli>),
}

impl TryFrom<&Cli> for AgentConfig {
    type Error = anyhow::Error;

    fn try_from(cli: &Cli) -> anyhow::Result<Self> {
        let controller = cli
            .controller
            .clone()
            .context("--controller (or TRAINYARD_CONTROLLER) is required, e.g. http://127.0.0.1:7070")?;
        let host_file = cli.host_file.clone();
        let slurm = match cli.slurm_job {
            Some(job) => Some(
                trainyard_agent::slurm::SlurmAgent::from_env(job, cli.join_token.clone().unwrap_or_default())
                    .map_err(anyhow::Error::msg)?,
            ),
            None => None,
        };
        let data_dir = cli
            .data_dir
            .clone()
            .or_else(|| slurm.as_ref().map(|s| s.default_data_dir()))
            .context("--data-dir is required")?;
        let mut config = AgentConfig::new(controller, host_file, data_dir);
        config.agent_id = cli.agent_id.clone().or_else(|| slurm.as_ref().map(|s| s.agent_id()));
        config.address = cli.address.clone();
        config.reserve_cpus = cli.reserve_cpus;
        if let Some(at) = cli.metrics_listen
            && !at.ip().is_loopback()
            && !cli.metrics_public
        {
            anyhow::bail!(
                "refusing --metrics-listen {at}: the agent's /metrics answers anyone who reaches it; \
                 keep it on 127.0.0.1 (scrape through a local proxy) or pass --metrics-public on a \
                 monitoring network"
            );
        }
        config.metrics_listen = cli.metrics_listen;
        config.metrics_addr_file = cli.metrics_addr_file.clone();
        config.allow_root_ranks = cli.allow_root_ranks;
        // An agent inside an allocation runs as its user, who cannot make cgroups there.
        config.subreaper_only = cli.process_tracking == ProcessTracking::Subreaper
            || (slurm.is_some() && trainyard_agent::account::effective_uid() != 0);
        config.rank_output_cap = cli.rank_output_cap_mib << 20;
        config.bootstrap_pythons = cli.bootstrap_python.clone();
        config.disk_floor = trainyard_agent::layout::DiskFloor {
            bytes: cli.disk_floor_mib << 20,
            percent: cli.disk_floor_percent,
        };
        if let Some(text) = &cli.preemption_notice {
            if slurm.is_some() {
                trainyard_agent::slurm::prepare_warning_dir(text).map_err(anyhow::Error::msg)?;
            }
            config.preemption_notice =
                Some(trainyard_agent::notice::NoticeSource::parse(text).map_err(anyhow::Error::msg)?);
        }
        config.notice_deadline = std::time::Duration::from_secs(cli.preemption_deadline_secs);
        config.telemetry = GpuSource::parse("telemetry", &cli.telemetry).map_err(anyhow::Error::msg)?;
        config.gpu_processes =
            GpuSource::parse("gpu-processes", &cli.gpu_processes).map_err(anyhow::Error::msg)?;
        let seconds = |v: f64, flag: &str, min: f64| {
            if v.is_finite() && v >= min && v <= 3600.0 {
                Ok(std::time::Duration::from_secs_f64(v))
            } else {
                anyhow::bail!("{flag} {v}: give seconds between {min} and 3600")
            }
        };
        config.telemetry_every = seconds(cli.telemetry_every_secs, "--telemetry-every-secs", 0.05)?;
        config.telemetry_window = seconds(cli.telemetry_window_secs, "--telemetry-window-secs", 0.1)?;
        if config.telemetry_window < config.telemetry_every {
            anyhow::bail!(
                "--telemetry-window-secs must be at least --telemetry-every-secs (a window holds readings)"
            );
        }
        config.tls = tls_files(cli, slurm.is_some())?;
        config.slurm = slurm;
        Ok(config)
    }
}

/// The agent's TLS files from its flags; `None`: plaintext. `joins` (an agent inside a Slurm
/// allocation) needs only the CA: its job's join token stands for a certificate.
fn tls_files(cli: &Cli, joins: bool) -> anyhow::Result<Option<TlsFiles>> {
    Ok(match (&cli.tls_dir, &cli.tls_ca, &cli.tls_cert, &cli.tls_key) {
        (None, None, None, None) => None,
        (dir, ca, cert, key) => {
            let base = dir.as_deref().map(TlsFiles::in_dir);
            let pick = |given: &Option<PathBuf>, from_dir: Option<PathBuf>, flag: &str| {
                given
                    .clone()
                    .or(from_dir)
                    .with_context(|| format!("{flag} (or --tls-dir) is required for TLS"))
            };
            let ca = pick(ca, base.as_ref().map(|b| b.ca.clone()), "--tls-ca")?;
            if joins && cert.is_none() && dir.is_none() {
                Some(TlsFiles { ca, cert: PathBuf::new(), key: PathBuf::new() })
            } else {
                Some(TlsFiles {
                    ca,
                    cert: pick(cert, base.as_ref().map(|b| b.cert.clone()), "--tls-cert")?,
                    key: pick(key, base.as_ref().map(|b| b.key.clone()), "--tls-key")?,
                })
            }
        }
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ProcessTracking {
    Auto,
    Subreaper,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Output {
    Text,
    Json,
}

fn main() -> ExitCode {
    // CUDA numbers devices fastest first unless told otherwise; NVML, the launcher's
    // CUDA_VISIBLE_DEVICES and the preflight's checks of a job's GPUs go by PCI bus order. Set
    // here, before any thread starts and before CUDA is loaded, so a CUDA ordinal in this
    // process is the NVML index.
    if std::env::var_os("CUDA_DEVICE_ORDER").is_none() {
        // SAFETY: the process has one thread here (the runtime starts later).
        unsafe { std::env::set_var("CUDA_DEVICE_ORDER", "PCI_BUS_ID") };
    }
    let cli = Cli::parse();
    match &cli.command {
        Some(Command::Preflight { level, output }) => return preflight(&cli, level, *output),
        Some(Command::Topo { file }) => return topo(&cli, file.as_deref()),
        Some(Command::Telemetry { gpus, count, output }) => return telemetry(&cli, gpus, *count, *output),
        Some(Command::NcclSweep { gpus, sizes }) => {
            let outcome = trainyard_agent::preflight::nccl::sweep_in_process(*gpus, sizes);
            println!("{}", serde_json::to_string(&outcome).unwrap_or_default());
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    if let Some(Command::Supervise(shim)) = cli.command {
        return shim::run(*shim);
    }
    init_tracing(cli.log_format);
    match daemon(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("trainyard-agent: failed to start: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `trainyard-agent preflight`: exit 0 on pass or warn, 1 on fail, 2 when it cannot run.
fn preflight(cli: &Cli, level: &str, output: Output) -> ExitCode {
    use trainyard_agent::preflight::{self, HostFacts, Request, Scope};

    let usage = |message: String| {
        eprintln!("trainyard-agent preflight: {message}");
        ExitCode::from(2)
    };
    let level = match preflight::runnable_level(level) {
        Ok(level) => level,
        Err(e) => return usage(e),
    };
    let probe = match host_probe(cli) {
        Ok(probe) => probe,
        Err(why) => return usage(why),
    };
    let agent_id = match (&cli.agent_id, probe.inventory()) {
        (Some(id), _) => id.clone(),
        (None, Ok(inventory)) => inventory.hostname,
        (None, Err(_)) => trainyard_agent::preflight::host::hostname(),
    };
    let facts = probe.host_facts().unwrap_or_else(HostFacts::gather);
    let job_env = Default::default();
    let report = preflight::run(
        &Request { level, agent_id: &agent_id, job_env: &job_env, scope: Scope::Node },
        probe.as_ref(),
        &facts,
    );
    match output {
        Output::Text => print!("{}", preflight::table::render(&report)),
        Output::Json => {
            // Beside the report: what the probe saw, so an operator can check NVML's inventory
            // (model, memory, UUID, PCI bus id, NUMA node) and the health values themselves.
            let mut json = preflight::to_json(&report);
            json["inventory"] = match probe.inventory() {
                Ok(inv) => inventory_json(&inv),
                Err(e) => serde_json::json!({"error": format!("{e:#}")}),
            };
            json["health"] = match probe.gpu_health() {
                Ok(health) => serde_json::to_value(&health).unwrap_or_default(),
                Err(why) => serde_json::json!({"skipped": why}),
            };
            println!("{}", serde_json::to_string_pretty(&json).unwrap_or_default())
        }
    }
    if report.verdict() == Ok(Verdict::Fail) { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}

/// `trainyard-agent telemetry`: `count` readings of each GPU, `--telemetry-every-secs` apart.
fn telemetry(cli: &Cli, gpus: &[u32], count: u32, output: Output) -> ExitCode {
    use trainyard_agent::telemetry::{GpuSampler, nvml::NvmlSampler, readout, script::ScriptedSampler};
    let failed = |message: String| {
        eprintln!("trainyard-agent telemetry: {message}");
        ExitCode::from(2)
    };
    let (mut sampler, all): (Box<dyn GpuSampler>, Vec<u32>) =
        match GpuSource::parse("telemetry", &cli.telemetry) {
            Err(e) => return failed(e),
            Ok(GpuSource::Off) => return failed("--telemetry off reads nothing".into()),
            Ok(GpuSource::Script(path)) => match ScriptedSampler::load(path) {
                Ok(s) => (Box::new(s), vec![0]),
                Err(e) => return failed(e),
            },
            Ok(GpuSource::Auto) => match NvmlSampler::new() {
                Ok(s) => {
                    let all = (0..s.gpu_count()).collect();
                    (Box::new(s), all)
                }
                Err(why) => return failed(why),
            },
        };
    let gpus = if gpus.is_empty() { all } else { gpus.to_vec() };
    eprintln!(
        "trainyard-agent telemetry: {} ({} GPU(s), {count} reading(s))",
        sampler.describe(),
        gpus.len()
    );
    let every = std::time::Duration::from_secs_f64(cli.telemetry_every_secs.clamp(0.05, 3600.0));
    let mut read_any = false;
    for i in 0..count {
        if i > 0 {
            std::thread::sleep(every);
        }
        let now = trainyard_agent::telemetry::now_ms();
        for &gpu in &gpus {
            match sampler.sample(gpu, now) {
                Ok(s) => {
                    read_any = true;
                    match output {
                        Output::Text => println!("{}", readout::to_line(&s)),
                        Output::Json => println!("{}", readout::to_json(&s)),
                    }
                }
                Err(e) => eprintln!("trainyard-agent telemetry: GPU {gpu}: {e}"),
            }
        }
    }
    if read_any { ExitCode::SUCCESS } else { failed("no GPU could be read".into()) }
}

fn topo(cli: &Cli, file: Option<&std::path::Path>) -> ExitCode {
    use trainyard_agent::topology::{self, Topology};

    if let Some(path) = file {
        return explain_pasted(path);
    }
    let probe = match host_probe(cli) {
        Ok(probe) => probe,
        Err(why) => return topo_failed(format!("no FILE, and {why}")),
    };
    let ours = match probe
        .inventory()
        .map_err(|e| format!("{e:#}"))
        .and_then(|inv| Topology::from_inventory(&inv).map_err(|e| e.to_string()))
    {
        Ok(t) => t,
        Err(e) => return topo_failed(format!("this host's inventory: {e}")),
    };
    let source = probe.source();
    println!("this host, from {source}:\n{}", topology::render(&ours));
    print!("{}", topology::explain(&ours));
    if source != "nvml" {
        return ExitCode::SUCCESS;
    }
    let smi = match std::process::Command::new("nvidia-smi").args(["topo", "-m"]).output() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("\nnvidia-smi topo -m: skipped: nvidia-smi is not on PATH");
            return ExitCode::SUCCESS;
        }
        Err(e) => return topo_failed(format!("cannot run nvidia-smi topo -m: {e}")),
        Ok(out) if !out.status.success() => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return topo_failed(format!("nvidia-smi topo -m exited with {}: {}", out.status, stderr.trim()));
        }
        Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
    };
    compare_with_smi(&ours, &smi)
}

/// `trainyard-agent topo FILE`: what a pasted `nvidia-smi topo -m` (`-` for standard input)
/// means for training.
fn explain_pasted(path: &std::path::Path) -> ExitCode {
    use std::io::Read;

    let (name, text) = if path.as_os_str() == "-" {
        let mut text = String::new();
        if let Err(e) = std::io::stdin().read_to_string(&mut text) {
            return topo_failed(format!("cannot read standard input: {e}"));
        }
        ("standard input".to_string(), text)
    } else {
        match std::fs::read_to_string(path) {
            Ok(text) => (path.display().to_string(), text),
            Err(e) => return topo_failed(format!("cannot read {}: {e}", path.display())),
        }
    };
    match trainyard_agent::topology::parse(&text) {
        Ok(t) => {
            print!("{}", trainyard_agent::topology::explain(&t));
            ExitCode::SUCCESS
        }
        Err(e) => topo_failed(format!("{name}: {e}")),
    }
}

/// NVML's matrix against `nvidia-smi topo -m`'s, cell for cell: exit 1 when they disagree.
fn compare_with_smi(ours: &trainyard_agent::topology::Topology, smi: &str) -> ExitCode {
    use trainyard_agent::topology;

    let theirs = match topology::parse(smi) {
        Ok(t) => t,
        Err(e) => return topo_failed(format!("cannot read the output of nvidia-smi topo -m: {e}")),
    };
    match topology::compare("NVML", ours, "nvidia-smi", &theirs).as_slice() {
        [] => {
            println!(
                "\nNVML and nvidia-smi topo -m agree cell for cell on {} GPU row(s): links, CPU and NUMA affinity",
                ours.gpus.len()
            );
            ExitCode::SUCCESS
        }
        diffs => {
            println!("\nNVML and nvidia-smi topo -m DISAGREE:");
            for d in diffs {
                println!("  {d}");
            }
            println!("\nnvidia-smi topo -m printed:\n{smi}");
            ExitCode::FAILURE
        }
    }
}

fn topo_failed(message: String) -> ExitCode {
    eprintln!("trainyard-agent topo: {message}");
    ExitCode::from(2)
}

/// The host file when one is given, NVML otherwise; the error says why neither can be used.
fn host_probe(cli: &Cli) -> Result<Box<dyn trainyard_agent::preflight::probe::HostProbe>, String> {
    use trainyard_agent::preflight::host::HostFile;
    use trainyard_agent::preflight::nvml::NvmlProbe;
    match &cli.host_file {
        Some(path) => HostFile::load(path).map(|f| Box::new(f) as _).map_err(|e| e.to_string()),
        None => NvmlProbe::new(trainyard_agent::preflight::host::hostname())
            .map(|p| Box::new(p) as _)
            .map_err(|why| format!("no --host-file and {why}")),
    }
}

fn inventory_json(inv: &trainyard_proto::v1::HostInventory) -> serde_json::Value {
    let gpus: Vec<serde_json::Value> = inv
        .gpus
        .iter()
        .map(|g| {
            serde_json::json!({"index": g.index, "model": g.model, "memory_mib": g.memory_mib, "uuid": g.uuid,
                "pci_bus_id": g.pci_bus_id, "numa_node": g.numa_node})
        })
        .collect();
    let numa: Vec<serde_json::Value> =
        inv.numa_nodes.iter().map(|n| serde_json::json!({"id": n.id, "cpus": n.cpus})).collect();
    serde_json::json!({"hostname": inv.hostname, "gpus": gpus, "numa_nodes": numa, "links": inv.links})
}

fn daemon(cli: &Cli) -> anyhow::Result<()> {
    let config = AgentConfig::try_from(cli)?;
    let runtime = tokio::runtime::Runtime::new().context("start the tokio runtime")?;
    runtime.block_on(trainyard_agent::run(config, shutdown_signal()))
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: a journal or a log file gets plain text, as the controller's.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Completes on ctrl-c or SIGTERM.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only ctrl-c stops the agent");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
    tracing::info!("shutdown requested");
}
