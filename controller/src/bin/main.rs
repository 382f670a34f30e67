//! `trainyard-controller`: the daemon. Parses flags, opens the store, serves until ctrl-c or
//! SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tokio::net::TcpListener;
use trainyard_controller::store::{self, SqliteStore};
use trainyard_controller::{Controller, ControllerConfig, server};

/// Schedules training jobs onto GPU hosts and stores the receipts their ranks write.
#[derive(Debug, Parser)]
#[command(name = "trainyard-controller", version)]
struct Cli {
    /// Address to serve gRPC on; port 0 picks a free port (see --addr-file).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Directory of the embedded SQLite database (trainyard.db).
    #[arg(long, default_value = "./trainyard-data")]
    data_dir: PathBuf,
    /// Database URL, overriding --data-dir: postgres://user@host/db for a fleet (the database
    /// must exist; tables are created on start), or sqlite:///var/lib/trainyard/trainyard.db.
    #[arg(long, env = "TRAINYARD_DB", hide_env_values = true)]
    db: Option<String>,
    /// Write the bound address here once listening (for scripts and tests using port 0).
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// Address to serve HTTP on (/metrics for Prometheus, /healthz); port 0 picks a free port
    /// (see --http-addr-file); "off" serves no HTTP.
    #[arg(long, default_value = "127.0.0.1:7071")]
    http_listen: String,
    /// Write the bound HTTP address here once listening.
    #[arg(long)]
    http_addr_file: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when ranks are stopped.
    #[arg(long, default_value_t = 10)]
    cancel_grace_secs: u64,
    /// Seconds an agent may stay away before its ranks count as lost.
    #[arg(long, default_value_t = 60)]
    agent_timeout_secs: u64,
    /// Seconds an agent may stay silent (no heartbeat, stream still open) before it counts as
    /// unresponsive and gets no new work; agents heartbeat every 2 s.
    #[arg(long, default_value_t = 15)]
    unresponsive_secs: u64,
    /// Log format on stderr.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

impl From<&Cli> for ControllerConfig {
    fn from(cli: &Cli) -> Self {
        ControllerConfig::default()
            .with_cancel_grace(Duration::from_secs(cli.cancel_grace_secs))
            .with_agent_timeout(Duration::from_secs(cli.agent_timeout_secs))
            .with_unresponsive_after(Duration::from_secs(cli.unresponsive_secs))
    }
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    init_logging(&cli.log_format);
    if let Err(e) = run(cli).await {
        eprintln!("trainyard-controller: failed to {e:#}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let store: Arc<dyn store::Store> = match &cli.db {
        Some(url) => store::open(url).await.with_context(|| format!("open the database {}", redact(url)))?,
        None => {
            std::fs::create_dir_all(&cli.data_dir)
                .with_context(|| format!("create the data directory {}", cli.data_dir.display()))?;
            let path = cli.data_dir.join("trainyard.db");
            Arc::new(
                SqliteStore::open_file(&path)
                    .await
                    .with_context(|| format!("open the database {}", path.display()))?,
            )
        }
    };
    let controller = Controller::start(store, ControllerConfig::from(&cli))
        .await
        .context("load jobs and agents from the store")?;
    let listener =
        TcpListener::bind(cli.listen).await.with_context(|| format!("listen on {}", cli.listen))?;
    let addr = listener.local_addr().context("read the bound address")?;
    if let Some(path) = &cli.addr_file {
        write_atomically(path, &addr.to_string()).with_context(|| format!("write {}", path.display()))?;
    }
    let http = match cli.http_listen.as_str() {
        "off" => None,
        text => {
            let at: SocketAddr = text
                .parse()
                .with_context(|| format!("--http-listen {text:?} is not an address like 127.0.0.1:7071"))?;
            let listener =
                TcpListener::bind(at).await.with_context(|| format!("listen on {at} (--http-listen)"))?;
            let bound = listener.local_addr().context("read the bound HTTP address")?;
            if let Some(path) = &cli.http_addr_file {
                write_atomically(path, &bound.to_string())
                    .with_context(|| format!("write {}", path.display()))?;
            }
            tracing::info!(addr = %bound, "serving /metrics and /healthz");
            Some(listener)
        }
    };
    tracing::info!(%addr, "trainyard-controller listening");
    server::run(listener, http, controller, shutdown_signal()).await.context("serve")
}

/// The URL without its password, for messages and logs.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

fn write_atomically(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, path)
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}
