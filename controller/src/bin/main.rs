//! `trainyard-controller`: the daemon. Parses flags, opens the store, serves until ctrl-c or
//! SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use tokio::net::TcpListener;
use trainyard_controller::auth::Policy;
use trainyard_controller::group::{Listeners, Member};
use trainyard_controller::http::Exposure;
use trainyard_controller::server::Security;
use trainyard_controller::tls::TlsFiles;
use trainyard_controller::{Controller, ControllerConfig, server};
use trainyard_store::SqlStore;

mod admin;

/// Schedules training jobs onto GPU hosts and stores the receipts their ranks write.
///
/// Without a subcommand it serves. On 127.0.0.1 with no TLS it runs as the no-setup demo:
/// calls without a token act as the local admin. Anywhere else it needs TLS (--tls-dir; see
/// `init-pki`), agents present certificates and users present tokens (`user add`).
#[derive(Debug, Parser)]
#[command(name = "trainyard-controller", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Address to serve gRPC on; port 0 picks a free port (see --addr-file).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Directory of the embedded SQLite database (trainyard.db).
    #[arg(long, default_value = "./trainyard-data", global = true)]
    data_dir: PathBuf,
    /// Database URL, overriding --data-dir: postgres://user@host/db for a fleet (the database
    /// must exist; tables are created on start), or sqlite:///var/lib/trainyard/trainyard.db.
    #[arg(long, env = "TRAINYARD_DB", hide_env_values = true, global = true)]
    db: Option<String>,
    /// Serve gRPC over TLS with the files `init-pki` wrote here: server.pem, server.key, and
    /// ca.pem (the CA agents' client certificates must be signed by).
    #[arg(long, env = "TRAINYARD_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// The server certificate (PEM), overriding --tls-dir's server.pem.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The server certificate's key (PEM), overriding --tls-dir's server.key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The CA that signs agents' client certificates (PEM), overriding --tls-dir's ca.pem.
    #[arg(long)]
    tls_client_ca: Option<PathBuf>,
    /// Serve plaintext gRPC on a non-loopback address: tokens and receipts cross the network
    /// unencrypted and agents are not authenticated. Only for an isolated test network.
    #[arg(long)]
    insecure_plaintext_on_network: bool,
    /// Serve the HTTP listener (web view, /metrics) in plain text on a non-loopback address
    /// without TLS: tokens cross the network in clear; an isolated network only.
    #[arg(long)]
    http_insecure_plaintext_on_network: bool,
    /// Let /metrics answer without a token on a non-loopback HTTP listener (a monitoring network
    /// whose scraper cannot send a bearer token). On loopback it never needs one.
    #[arg(long)]
    metrics_public: bool,
    /// Highest job priority a non-admin user may submit.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    max_user_priority: i32,
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
    /// Seconds an agent may stay disconnected or silent (no heartbeat) before its host counts as
    /// lost and its jobs restart elsewhere; agents heartbeat every 2 s.
    #[arg(long, default_value_t = 8)]
    agent_timeout_secs: u64,
    /// A waiting job whose priority exceeds a running job's by at least this preempts it
    /// (checkpoint, then requeue); 0: never.
    #[arg(long, default_value_t = 10)]
    preempt_gap: i32,
    /// Seconds a preempted job has to checkpoint.
    #[arg(long, default_value_t = 120)]
    preempt_deadline_secs: u64,
    /// A waiting job gains a priority point per this many seconds of waiting (0: no aging).
    #[arg(long, default_value_t = 600)]
    age_every_secs: u64,
    /// Seconds a gone agent's verdict waits while its jobs' ranks on other hosts keep stepping
    /// (its ranks outlive it), for it to come back and adopt them.
    #[arg(long, default_value_t = 120)]
    agent_hold_secs: u64,
    /// Seconds an attempt waits for a silent host of it (counted from its last word, like the
    /// hold above) when no other placement can start now, so that the host's ranks are taken
    /// back if it returns; a job's `[restart] host_wait_s` overrides it.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    host_wait_secs: u64,
    /// Seconds an agent may stay silent (no heartbeat, stream still open) before it counts as
    /// unresponsive and gets no new work.
    #[arg(long, default_value_t = 5)]
    unresponsive_secs: u64,
    /// Seconds agents have to reconnect after this controller starts before any host-loss or
    /// hang clock runs.
    #[arg(long, default_value_t = 30)]
    reconnect_grace_secs: u64,
    /// Blamed failures within --blame-window-secs that cordon a node until it passes a
    /// preflight (0: never cordon automatically).
    #[arg(long, default_value_t = 3)]
    cordon_after_blames: usize,
    #[arg(long, default_value_t = 3600)]
    blame_window_secs: u64,
    /// Seconds between two rounds of the live diagnosis of running jobs.
    #[arg(long, default_value_t = 10)]
    live_diagnosis_secs: u64,
    /// POST each live finding, when it opens and when it closes, to this URL as JSON with a
    /// Slack-compatible `text` (repeat for several targets).
    #[arg(long = "alert-webhook", env = "TRAINYARD_ALERT_WEBHOOK", value_delimiter = ',')]
    alert_webhooks: Vec<String>,
    /// CA bundle for https webhooks (default: /etc/ssl/certs/ca-certificates.crt).
    #[arg(long)]
    alert_ca_file: Option<PathBuf>,
    /// This controller's id in its group (several controllers on one PostgreSQL; default:
    /// hostname and pid). Unused on SQLite, which serves one controller.
    #[arg(long, env = "TRAINYARD_CONTROLLER_ID")]
    controller_id: Option<String>,
    /// Where agents and tools reach this controller (host:port), as the group's lease
    /// advertises it and followers name it to writers (default: the bound --listen address; give
    /// a name in the TLS certificate when agents dial by name).
    #[arg(long, env = "TRAINYARD_ADVERTISE")]
    advertise: Option<String>,
    /// Seconds a leader's lease lasts without renewal (renewed every fifth of it); a follower
    /// takes over this long after the leader died.
    #[arg(long, default_value_t = 5.0)]
    lease_ttl_secs: f64,
    /// Days GPU telemetry windows are kept (0: for ever).
    #[arg(long, default_value_t = 30)]
    telemetry_retention_days: u64,
    /// MiB of step receipts one job may store; past it they are dropped, counted and shown on
    /// the job (docs/security.md, "Limits").
    #[arg(long, default_value_t = 32768)]
    receipt_quota_job_mib: u64,
    /// MiB of receipts of other kinds one job may store.
    #[arg(long, default_value_t = 1024)]
    receipt_quota_job_other_mib: u64,
    /// MiB of receipts one user's unfinished jobs may store together.
    #[arg(long, default_value_t = 131072)]
    receipt_quota_user_mib: u64,
    /// Days the receipts of an ended job are kept (0: for ever); its plot rollups, goodput and
    /// findings stay.
    #[arg(long, default_value_t = 0)]
    receipt_retention_days: u64,
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
            .with_reconnect_grace(Duration::from_secs(cli.reconnect_grace_secs))
            .with_agent_hold(Duration::from_secs(cli.agent_hold_secs))
            .with_host_wait(Duration::from_secs(cli.host_wait_secs))
            .with_preemption(
                cli.preempt_gap,
                Duration::from_secs(cli.preempt_deadline_secs),
                Duration::from_secs(cli.age_every_secs),
            )
            .with_cordon_after(cli.cordon_after_blames, Duration::from_secs(cli.blame_window_secs))
            .with_live(
                Duration::from_secs(cli.live_diagnosis_secs.max(1)),
                cli.alert_webhooks.clone(),
                cli.alert_ca_file.clone(),
            )
            .with_telemetry_retention(
                (cli.telemetry_retention_days > 0)
                    .then(|| Duration::from_secs(cli.telemetry_retention_days * 86_400)),
            )
            .with_receipt_quota(
                trainyard_controller::config::QuotaConfig {
                    job_step_bytes: cli.receipt_quota_job_mib << 20,
                    job_other_bytes: cli.receipt_quota_job_other_mib << 20,
                    user_bytes: cli.receipt_quota_user_mib << 20,
                },
                (cli.receipt_retention_days > 0)
                    .then(|| Duration::from_secs(cli.receipt_retention_days * 86_400)),
            )
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write a CA, the controller's TLS certificate and agents' client certificates into DIR
    /// (nothing else is needed for a small fleet; bring your own certificates otherwise).
    InitPki {
        /// Directory to write (ca.pem, ca.key, server.pem, server.key, agents/NAME/).
        #[arg(long)]
        dir: PathBuf,
        /// A name or address agents and ctl dial the controller by (repeat; localhost,
        /// 127.0.0.1 and ::1 are always included).
        #[arg(long = "san")]
        sans: Vec<String>,
        /// An agent to issue a client certificate for (repeat).
        #[arg(long = "agent")]
        agents: Vec<String>,
        /// Days the server and agent certificates are valid.
        #[arg(long, default_value_t = trainyard_controller::auth::pki::DEFAULT_DAYS)]
        days: u32,
    },
    /// Issue a client certificate for one more agent from the CA in --pki-dir; copy the
    /// directory it prints to that node.
    IssueAgentCert {
        /// The agent's id (its --agent-id, by default its hostname).
        name: String,
        #[arg(long)]
        pki_dir: PathBuf,
        #[arg(long, default_value_t = trainyard_controller::auth::pki::DEFAULT_DAYS)]
        days: u32,
    },
    /// Add users, issue and revoke their tokens (in the store; works while the controller runs).
    User {
        #[command(subcommand)]
        action: admin::UserCommand,
    },
    /// Print the newest rows of the audit log.
    Audit {
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    init_logging(&cli.log_format);
    let result = match &cli.command {
        None => run(cli).await,
        Some(command) => admin::run(command, &cli).await,
    };
    if let Err(e) = result {
        eprintln!("trainyard-controller: failed to {e:#}");
        std::process::exit(1);
    }
}

/// How the gRPC listener is secured, from the flags: TLS when given; plaintext only on
/// loopback (the demo) or with the loud flag.
fn security(cli: &Cli) -> anyhow::Result<Security> {
    let tls = match (&cli.tls_dir, &cli.tls_cert, &cli.tls_key) {
        (dir, Some(cert), Some(key)) => Some(TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: cli.tls_client_ca.clone().or_else(|| dir.as_ref().map(|d| d.join("ca.pem"))).context(
                "--tls-cert needs --tls-client-ca (the CA of the agents' certificates) or --tls-dir",
            )?,
        }),
        (Some(dir), _, _) => {
            let mut files = TlsFiles::in_dir(dir);
            if let Some(ca) = &cli.tls_client_ca {
                files.client_ca = ca.clone();
            }
            Some(files)
        }
        (None, _, _) => None,
    };
    let loopback = cli.listen.ip().is_loopback();
    Ok(match tls {
        Some(tls) => {
            tracing::info!("gRPC over TLS: agents present client certificates, users present tokens");
            Security { tls: Some(tls), policy: Policy::secure(cli.max_user_priority) }
        }
        None if loopback => {
            tracing::warn!(
                "demo mode: plaintext gRPC on loopback; calls without a token act as the local admin \
                 'local' and agents are not authenticated. To put the controller on a network, see \
                 `trainyard-controller init-pki` and --tls-dir"
            );
            Security::demo()
        }
        None if cli.insecure_plaintext_on_network => {
            tracing::warn!(
                listen = %cli.listen,
                "INSECURE: plaintext gRPC on a network address (--insecure-plaintext-on-network): tokens \
                 and receipts cross the network unencrypted and agents are not authenticated"
            );
            let policy = Policy { require_agent_cert: false, ..Policy::secure(cli.max_user_priority) };
            Security { tls: None, policy }
        }
        None => bail!(
            "refusing to serve plaintext gRPC on {}: anyone who can reach it could run programs on every \
             GPU host. Give --tls-dir (`trainyard-controller init-pki --dir DIR` writes one), listen on \
             127.0.0.1, or pass --insecure-plaintext-on-network on an isolated network",
            cli.listen
        ),
    })
}

/// How the HTTP listener at `bound` is exposed. On loopback: plain HTTP, as the gRPC listener's
/// policy says. Off loopback: HTTPS with the gRPC listener's certificate when it has one;
/// without TLS, only with --http-insecure-plaintext-on-network. Calls there always need a token
/// (the server enforces it), `/metrics` too unless --metrics-public.
fn http_exposure(cli: &Cli, bound: SocketAddr, security: &Security) -> anyhow::Result<Exposure> {
    let public_metrics = cli.metrics_public;
    if bound.ip().is_loopback() {
        return Ok(Exposure { tls: None, public_metrics });
    }
    if let Some(tls) = &security.tls {
        return Ok(Exposure { tls: Some(tls.clone()), public_metrics });
    }
    if !cli.http_insecure_plaintext_on_network {
        bail!(
            "refusing to serve the web view and /metrics in plain text on {bound}: tokens would cross \
             the network in clear. Give --tls-dir (the HTTP listener then serves HTTPS with the same \
             certificate), keep --http-listen on 127.0.0.1, or pass --http-insecure-plaintext-on-network \
             on an isolated network"
        );
    }
    tracing::warn!(%bound, "INSECURE: plain-text HTTP on a network address; every call still needs a token");
    Ok(Exposure { tls: None, public_metrics })
}

/// Creates the data directory 0700 whatever the umask (it holds the database); one that exists
/// is left as the operator made it.
fn create_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Opens the store the flags name (--db, else the SQLite file in --data-dir).
async fn open_store(cli: &Cli) -> anyhow::Result<SqlStore> {
    Ok(match &cli.db {
        Some(url) => {
            SqlStore::open(url).await.with_context(|| format!("open the database {}", redact(url)))?
        }
        None => {
            create_private_dir(&cli.data_dir)
                .with_context(|| format!("create the data directory {}", cli.data_dir.display()))?;
            let path = cli.data_dir.join("trainyard.db");
            SqlStore::open_sqlite_file(&path)
                .await
                .with_context(|| format!("open the database {}", path.display()))?
        }
    })
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match trainyard_controller::server::raise_open_file_limit() {
        Ok((before, after)) if after > before => tracing::info!(before, after, "raised the open-file limit"),
        Ok((_, limit)) => tracing::info!(limit, "open-file limit"),
        Err(e) => tracing::warn!(error = %e, "could not read or raise the open-file limit"),
    }
    let security = security(&cli)?;
    let store = open_store(&cli).await?;
    // Held for the process's life: a second controller on the same SQLite file refuses to start.
    let claim = store.claim_for_controller().context("claim the SQLite database for this controller")?;
    let store: Arc<dyn trainyard_store::Store> = Arc::new(store);
    let listeners = bind_listeners(&cli, &security).await?;
    // On PostgreSQL several controllers may share the database: lead or follow.
    let group = match (&claim, cli.db.as_deref()) {
        (None, Some(url)) if url.starts_with("postgres") => {
            let bound = listeners.grpc.local_addr().context("read the bound address")?;
            Some(group_config(&cli, bound, &security)?)
        }
        _ => {
            trainyard_controller::metrics::metrics().leading(true, 0);
            None
        }
    };
    let Some(group) = group else {
        let controller = Controller::start(store.clone(), ControllerConfig::from(&cli))
            .await
            .context("load jobs and agents from the store")?;
        let (grpc, http) = listeners.dup()?;
        return server::run(grpc, http, controller, security, shutdown_signal()).await.context("serve");
    };
    let member = Member { store, group, config: ControllerConfig::from(&cli), security };
    member.serve(&listeners, shutdown_signal).await
}

/// Binds the gRPC and HTTP listeners the flags name, once for the process's life.
async fn bind_listeners(cli: &Cli, security: &Security) -> anyhow::Result<Listeners> {
    let grpc = TcpListener::bind(cli.listen).await.with_context(|| format!("listen on {}", cli.listen))?;
    let addr = grpc.local_addr().context("read the bound address")?;
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
            let exposure = http_exposure(cli, bound, security)?;
            if let Some(path) = &cli.http_addr_file {
                write_atomically(path, &bound.to_string())
                    .with_context(|| format!("write {}", path.display()))?;
            }
            let scheme = if exposure.tls.is_some() { "https" } else { "http" };
            tracing::info!(addr = %bound, scheme, "serving the web view, /metrics and /healthz");
            Some((listener, exposure))
        }
    };
    tracing::info!(%addr, "trainyard-controller listening");
    Ok(Listeners { grpc, http })
}

/// The group settings of a controller on PostgreSQL.
fn group_config(
    cli: &Cli,
    bound: SocketAddr,
    security: &Security,
) -> anyhow::Result<trainyard_controller::core::leader::GroupConfig> {
    if !(cli.lease_ttl_secs.is_finite() && (1.0..=300.0).contains(&cli.lease_ttl_secs)) {
        bail!("--lease-ttl-secs {}: give seconds between 1 and 300", cli.lease_ttl_secs);
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let id = cli.controller_id.clone().unwrap_or_else(|| format!("{}-{}", host.trim(), std::process::id()));
    Ok(trainyard_controller::core::leader::GroupConfig {
        id,
        // A wildcard address names no host: the hostname stands in for it.
        address: cli.advertise.clone().unwrap_or_else(|| match bound.ip().is_unspecified() {
            true => format!("{}:{}", host.trim(), bound.port()),
            false => bound.to_string(),
        }),
        ttl: Duration::from_secs_f64(cli.lease_ttl_secs),
        tls_ca: match &security.tls {
            Some(tls) => {
                let pem = std::fs::read(&tls.client_ca)
                    .with_context(|| format!("read the CA {}", tls.client_ca.display()))?;
                let digest = <sha2::Sha256 as sha2::Digest>::digest(pem.trim_ascii());
                digest.iter().map(|b| format!("{b:02x}")).collect()
            }
            None => String::new(),
        },
    })
}

/// The URL without its password, for messages and logs.
/// A database URL as it may be printed: the password of `user:password@` and of a
/// `password=`/`sslpassword=` query parameter replaced by `***`.
fn redact(url: &str) -> String {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let base = match (base.find("://"), base.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => match base[scheme + 3..at].split_once(':') {
            Some((user, _)) => format!("{}{user}:***{}", &base[..scheme + 3], &base[at..]),
            None => base.to_string(),
        },
        _ => base.to_string(),
    };
    let Some(query) = query else { return base };
    let params: Vec<String> = query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") || k.eq_ignore_ascii_case("sslpassword") => {
                format!("{k}=***")
            }
            _ => p.to_string(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
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

#[cfg(test)]
mod tests {
    #[test]
    fn database_passwords_never_print() {
        let cases = [
            ("postgres://ty:s3cret@db:5432/trainyard", "postgres://ty:***@db:5432/trainyard"),
            (
                "postgres://db/trainyard?user=ty&password=s3cret&sslmode=require",
                "postgres://db/trainyard?user=ty&password=***&sslmode=require",
            ),
            ("postgres://ty:a@b@db/x?sslpassword=k", "postgres://ty:***@db/x?sslpassword=***"),
            ("postgres://db/trainyard", "postgres://db/trainyard"),
        ];
        for (url, shown) in cases {
            assert_eq!(super::redact(url), shown);
            assert!(!super::redact(url).contains("s3cret"));
        }
    }
}
