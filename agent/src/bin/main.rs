//! `trainyard-agent`: the host agent daemon, and (`supervise`) the per-rank shim it runs.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use trainyard_agent::AgentConfig;
use trainyard_agent::pinning::Binding;
use trainyard_agent::supervise::{SuperviseArgs, supervise};

#[derive(Debug, Parser)]
#[command(name = "trainyard-agent", version, about = "trainyard's host agent")]
struct Cli {
    /// Controller URL.
    #[arg(long, env = "TRAINYARD_CONTROLLER", global = true)]
    controller: Option<String>,
    /// JSON host-description file (stands in for NVML).
    #[arg(long, global = true)]
    host_file: Option<PathBuf>,
    /// Directory for run directories and the agent's state.
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    /// Identity in the fleet (default: the host file's hostname).
    #[arg(long, global = true)]
    agent_id: Option<String>,
    /// Address other hosts dial for MASTER_ADDR.
    #[arg(long, default_value = "127.0.0.1", global = true)]
    address: String,
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    /// CPUs kept for the agent: the lowest-numbered N CPUs never get a rank pinned to them.
    #[arg(long, default_value_t = 0, global = true)]
    reserve_cpus: u32,
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
    /// Internal: the per-rank shim the agent starts for every rank.
    #[command(hide = true)]
    Supervise {
        #[arg(long)]
        status_file: PathBuf,
        #[arg(long)]
        pid_file: PathBuf,
        /// CPUs to bind the rank to (kernel list format, e.g. 0-15).
        #[arg(long)]
        cpus: Option<String>,
        /// NUMA node the rank's memory is bound to (MPOL_BIND).
        #[arg(long)]
        mem_node: Option<u32>,
        /// The rank's program and arguments.
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
}

impl TryFrom<&Cli> for AgentConfig {
    type Error = anyhow::Error;

    fn try_from(cli: &Cli) -> anyhow::Result<Self> {
        let controller = cli
            .controller
            .clone()
            .context("--controller (or TRAINYARD_CONTROLLER) is required, e.g. http://127.0.0.1:7070")?;
        let host_file = cli.host_file.clone().context("--host-file is required")?;
        let data_dir = cli.data_dir.clone().context("--data-dir is required")?;
        let mut config = AgentConfig::new(controller, host_file, data_dir);
        config.agent_id = cli.agent_id.clone();
        config.address = cli.address.clone();
        config.reserve_cpus = cli.reserve_cpus;
        Ok(config)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Supervise { status_file, pid_file, cpus, mem_node, argv }) = cli.command {
        // A binding that cannot even be parsed leaves the rank unpinned; the read-back and
        // the controller's warning tell the operator (see `trainyard_agent::pinning`).
        let binding = Binding::from_flags(cpus.as_deref(), mem_node).unwrap_or_else(|e| {
            eprintln!("trainyard-agent supervise: {e}; the rank runs unpinned");
            None
        });
        let code = supervise(&SuperviseArgs { status_file, pid_file, binding, argv });
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
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

fn daemon(cli: &Cli) -> anyhow::Result<()> {
    let config = AgentConfig::try_from(cli)?;
    let runtime = tokio::runtime::Runtime::new().context("start the tokio runtime")?;
    runtime.block_on(trainyard_agent::run(config, shutdown_signal()))
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
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
