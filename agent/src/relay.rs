//! The daemon's entry point: prepare, then dial the controller and keep a stream up until
//! shutdown.
//!
//! Reconnects use capped exponential backoff (100 ms doubling to 5 s, each delay jittered to
//! 50-100 % so a fleet that lost its controller does not return in lockstep), reset once a
//! stream was established. A protocol mismatch (`FailedPrecondition`) is logged as an error and
//! retried every 30 s rather than exiting: the ranks on this host keep running and keep their
//! receipts, and the agent reconnects by itself once the controller is upgraded or rolled back.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity as TlsIdentity};
use tracing::{error, info, warn};
use trainyard_proto::v1::agents_client::AgentsClient;

use crate::config::AgentConfig;
use crate::connection::{self, Ended, Identity};
use crate::launcher::Launcher;
use crate::layout::Layout;
use crate::preflight::failure_reason;
use crate::preflight::host::HostFile;
use crate::preflight::nvml::NvmlProbe;
use crate::preflight::probe::HostProbe;
use crate::preflight::runner::Runner;
use trainyard_proto::words::PreflightLevel;

/// The host description: the host file when one is given, else NVML on a real GPU host.
fn probe(config: &AgentConfig) -> anyhow::Result<Arc<dyn HostProbe>> {
    match &config.host_file {
        Some(path) => Ok(Arc::new(HostFile::load(path)?)),
        None => {
            let hostname = crate::preflight::host::hostname();
            let probe = NvmlProbe::new(hostname).map_err(|why| {
                anyhow::anyhow!("no --host-file, and NVML cannot describe this host: {why}")
            })?;
            Ok(Arc::new(probe))
        }
    }
}

/// The address to advertise: the local address of a connection to the controller, or, when
/// that cannot be found, the one advertised before (127.0.0.1 at first), with a warning.
async fn advertised_address(controller: &str, previous: &str) -> String {
    match crate::address::detect(controller).await {
        Ok(ip) => {
            let ip = ip.to_string();
            if ip != previous {
                info!(address = %ip, "advertising the address this host reaches the controller from (MASTER_ADDR)");
            }
            ip
        }
        Err(e) => {
            warn!(error = %e, address = %previous, "cannot detect this host's address; set --address");
            previous.to_string()
        }
    }
}

/// How often the agent pings its controller, and how long an answer may take: a frozen leader
/// is left within 5 s, about when its lease (5 s by default) lets another take over. HTTP/2
/// pings are answered by the connection's task, not by request handlers, so a busy controller
/// still answers in time.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(2);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);

const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_CAP: Duration = Duration::from_secs(5);
const REFUSED_RETRY: Duration = Duration::from_secs(30);

/// Runs the agent until `shutdown` completes: adopts the ranks recorded in the data
/// directory, then relays to the controller. Errors are start-up errors (bad host file,
/// unusable data directory); after start-up, problems are logged and retried. Ranks keep
/// running when this returns.
pub async fn run(config: AgentConfig, shutdown: impl Future) -> anyhow::Result<()> {
    let host = probe(&config)?;
    let mut inventory = host.inventory()?;
    crate::pinning::reserve_cpus(&mut inventory, config.reserve_cpus);
    if let Some(slurm) = &config.slurm {
        match crate::slurm::allowed_cpus() {
            Some(allowed) => crate::slurm::restrict_to(&mut inventory, &allowed),
            None => warn!("cannot read this process's CPU affinity; pinning plans from the whole node"),
        }
        info!(job_id = slurm.job, slurm_job_id = %slurm.slurm_job_id, node = %slurm.node, "inside a Slurm allocation");
    }
    let agent_id = config.agent_id.clone().unwrap_or_else(|| inventory.hostname.clone());
    let preflight = start_up_preflight(&agent_id, host).await;
    let (notice_tx, notices) = tokio::sync::watch::channel(None);
    if let Some(source) = config.preemption_notice.clone() {
        tokio::spawn(crate::notice::watch(source, config.notice_poll, config.notice_deadline, notice_tx));
    }
    let mut identity = Identity {
        agent_id,
        address: config.address.clone().unwrap_or_else(|| "127.0.0.1".into()),
        inventory: inventory.clone(),
        preflight,
        notices,
    };
    if let Some(at) = config.metrics_listen {
        serve_metrics(at, config.metrics_addr_file.as_deref()).await?;
    }
    let layout = Layout::new(&config.data_dir);
    let mut launcher = Launcher::new(layout, config.shim_program.clone(), inventory)
        .with_context(|| format!("prepare data directory {}", config.data_dir.display()))?
        .allow_root_ranks(config.allow_root_ranks)
        .with_limits(config.rank_output_cap, config.disk_floor)
        .with_gpu_holders(gpu_holders(&config.gpu_processes))
        .precompile_bootstrap(&config.bootstrap_pythons);
    if config.subreaper_only {
        let tracking = crate::cgroup::Tracking::Subreaper("--process-tracking subreaper".into());
        info!("{}", tracking.describe());
        launcher = launcher.with_tracking(tracking);
    }
    if config.allow_root_ranks && crate::account::effective_uid() == 0 {
        warn!(
            "--allow-root-ranks: jobs that name no Unix account run their ranks as root on this node; never use it on a shared node"
        );
    }
    let adopted = launcher.adopt().context("read rank state files")?;
    let telemetry = crate::telemetry::Telemetry::default();
    let _sampling = start_telemetry(&config, &telemetry)?;
    info!(agent_id = %identity.agent_id, adopted, controller = %config.controller, "agent started");
    relay(&config, &mut identity, &mut launcher, &telemetry, shutdown).await
}

/// Dials the controller(s) and serves one stream after another until `shutdown`. Several
/// controllers (a group on PostgreSQL): the agent dials them in turn, moving on when one
/// cannot be reached or its stream ends; only the leader listens.
async fn relay(
    config: &AgentConfig,
    identity: &mut Identity,
    launcher: &mut Launcher,
    telemetry: &crate::telemetry::Telemetry,
    shutdown: impl Future,
) -> anyhow::Result<()> {
    let mut dial = Dial::new(config).await?;
    tokio::pin!(shutdown);
    loop {
        let url = dial.urls[dial.at].clone();
        let channel: Result<Channel, _> = tokio::select! {
            biased;
            _ = &mut shutdown => return Ok(()),
            channel = dial.endpoints[dial.at].connect() => channel,
        };
        let delay = match channel {
            Ok(channel) => {
                if config.address.is_none() {
                    identity.address = advertised_address(&url, &identity.address).await;
                }
                let client = AgentsClient::new(channel)
                    .max_decoding_message_size(trainyard_proto::limits::MAX_AGENT_MESSAGE_BYTES)
                    .max_encoding_message_size(trainyard_proto::limits::MAX_AGENT_MESSAGE_BYTES);
                let ended =
                    connection::serve(config, identity, launcher, telemetry, client, shutdown.as_mut()).await;
                match dial.after(ended, &url, config)? {
                    Some(delay) => delay,
                    None => return Ok(()),
                }
            }
            Err(e) => {
                warn!(controller = %url, error = %e, "cannot reach controller");
                dial.at = (dial.at + 1) % dial.urls.len();
                dial.backoff.next_delay()
            }
        };
        tokio::select! {
            biased;
            _ = &mut shutdown => return Ok(()),
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// The controllers an agent dials, which one is next, and how long it waits between dials.
struct Dial {
    urls: Vec<String>,
    endpoints: Vec<Endpoint>,
    at: usize,
    backoff: Backoff,
    /// The controller whose open stream just ended (it died, froze or stepped down), and when:
    /// for a while a follower that still names it as the leader is asked again rather than
    /// believed, since its lease may not have run out yet.
    suspect: Option<(usize, std::time::Instant)>,
}

impl Dial {
    async fn new(config: &AgentConfig) -> anyhow::Result<Dial> {
        let dials = resolve_controllers(controller_urls(&config.controller)?).await;
        let urls: Vec<String> = dials.iter().map(|(url, _)| url.clone()).collect();
        let endpoints = dials
            .iter()
            .map(|(url, name)| endpoint(url, config, name.as_deref()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Dial { urls, endpoints, at: 0, backoff: Backoff::default(), suspect: None })
    }

    /// After the stream to `url` ended: how long to wait before the next dial (and whom it
    /// dials, in `at`); `None` when the agent is stopping.
    fn after(&mut self, ended: Ended, url: &str, config: &AgentConfig) -> anyhow::Result<Option<Duration>> {
        let at = self.at;
        let mut next = Some((at + 1) % self.urls.len());
        let delay = match ended {
            Ended::Shutdown if config.slurm.is_some() => {
                info!("agent stopped with its allocation");
                return Ok(None);
            }
            Ended::Shutdown => {
                info!("agent stopped; ranks keep running");
                return Ok(None);
            }
            Ended::Dismissed(reason) => {
                info!(reason, "agent done: its job ended");
                return Ok(None);
            }
            // An allocation's agent is refused for good (a token of another job, or of one that
            // ended): it stops, which ends its Slurm step and frees the node.
            Ended::Refused(message) if config.slurm.is_some() => {
                error!(reason = %message, "the controller refused this agent of a Slurm allocation; stopping");
                anyhow::bail!(
                    "the controller refused this agent of a Slurm allocation (its token is good for one job, \
                     while that job runs): {message}"
                );
            }
            Ended::Refused(message) => {
                error!(reason = %message, retry_in_s = REFUSED_RETRY.as_secs(),
                    "controller refused this agent (a protocol mismatch or a credential it does not accept)");
                REFUSED_RETRY
            }
            Ended::NotLeader { leader } => {
                self.backoff = Backoff::default();
                match redirect(&mut self.urls, &mut self.endpoints, config, at, &leader, self.suspect)? {
                    Some(to) => {
                        next = Some(to);
                        REDIRECT_DELAY
                    }
                    // A follower that still names the leader that just went away: ask it
                    // again shortly.
                    None => {
                        next = Some(at);
                        SUSPECT_RETRY
                    }
                }
            }
            Ended::Disconnected { error, established } => {
                if established {
                    self.backoff = Backoff::default();
                    if self.urls.len() == 1 {
                        // The one controller may come back (a restart): dial it again.
                        next = None;
                    } else {
                        // A group: another member leads now, or names who does. The one
                        // that just went away may be frozen: dialing it would hang.
                        self.suspect = Some((at, std::time::Instant::now()));
                    }
                }
                warn!(controller = %url, error = %format!("{error:#}"), "disconnected from controller");
                self.backoff.next_delay()
            }
        };
        if let Some(to) = next {
            self.at = to;
        }
        Ok(Some(delay))
    }
}

/// Where to dial after the follower at `urls[at]` named `leader` (host:port): the leader's
/// index, added to the list (in the follower's scheme) when it is not there, as with one DNS
/// name for the group; `None` while `suspect`, the controller whose stream just ended, is the
/// one named (the follower's view may be a lease that has not run out yet).
fn redirect(
    urls: &mut Vec<String>,
    endpoints: &mut Vec<Endpoint>,
    config: &AgentConfig,
    at: usize,
    leader: &str,
    suspect: Option<(usize, std::time::Instant)>,
) -> anyhow::Result<Option<usize>> {
    let leader_url = trainyard_proto::contract::leader_url(&urls[at], leader);
    let to = match urls.iter().position(|u| same_address(u, &leader_url)) {
        Some(i) if suspect.is_some_and(|(s, since)| s == i && since.elapsed() < SUSPECT_FOR) => {
            info!(follower = %urls[at], leader = %urls[i],
                "the follower still names a leader whose stream just ended; asking it again shortly");
            return Ok(None);
        }
        Some(i) => i,
        None if urls.len() < MAX_CONTROLLER_URLS => {
            endpoints.push(endpoint(&leader_url, config, None)?);
            urls.push(leader_url);
            urls.len() - 1
        }
        None => (at + 1) % urls.len(),
    };
    info!(follower = %urls[at], leader = %urls[to], "this controller follows; dialing the leader it names");
    crate::metrics::metrics().redirects.inc();
    Ok(Some(to))
}

/// Controller URLs an agent keeps at most: those given, plus leaders followers named.
const MAX_CONTROLLER_URLS: usize = 16;
/// Pause before dialing the leader a follower named (so a stale name cannot spin).
const REDIRECT_DELAY: Duration = Duration::from_millis(100);
/// How long a controller whose stream ended stays suspect (longer than a default lease of 5 s:
/// a frozen leader's runs out meanwhile; one that is alive is believed again after it), and how
/// long to wait before asking a follower that names it again.
const SUSPECT_FOR: Duration = Duration::from_secs(8);
const SUSPECT_RETRY: Duration = Duration::from_millis(500);

/// Two controller URLs name the same scheme, host and port.
fn same_address(a: &str, b: &str) -> bool {
    let norm = |u: &str| u.trim_end_matches('/').to_ascii_lowercase();
    norm(a) == norm(b)
}

/// Stops the sampling thread when dropped (the agent returns).
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What tells a launch which processes compute on a GPU: NVML where the host has a driver
/// (`auto`), a file standing in for it, or nothing (the ranks' cgroups alone decide).
fn gpu_holders(source: &crate::config::GpuSource) -> Option<Arc<dyn crate::gpu_holders::GpuHolders>> {
    use crate::config::GpuSource;
    use crate::gpu_holders::{NvmlHolders, ScriptedHolders};
    match source {
        GpuSource::Off => None,
        GpuSource::Script(path) => Some(Arc::new(ScriptedHolders::new(path.clone()))),
        GpuSource::Auto => match NvmlHolders::new() {
            Ok(nvml) => Some(Arc::new(nvml)),
            Err(why) => {
                info!(reason = %why, "GPU compute processes not read: the ranks' cgroups alone say who holds a GPU");
                None
            }
        },
    }
}

/// Starts the GPU telemetry thread the configuration asks for. A script that does not load is
/// a start-up error; NVML missing on an `auto` host is logged as skipped.
fn start_telemetry(
    config: &AgentConfig,
    telemetry: &crate::telemetry::Telemetry,
) -> anyhow::Result<Option<StopOnDrop>> {
    use crate::config::GpuSource;
    use crate::telemetry::{GpuSampler, nvml::NvmlSampler, script::ScriptedSampler};
    let sampler: Box<dyn GpuSampler> = match &config.telemetry {
        GpuSource::Off => return Ok(None),
        GpuSource::Script(path) => Box::new(ScriptedSampler::load(path.clone()).map_err(anyhow::Error::msg)?),
        GpuSource::Auto => match NvmlSampler::new() {
            Ok(sampler) => Box::new(sampler),
            Err(why) => {
                info!(reason = %why, "GPU telemetry skipped");
                return Ok(None);
            }
        },
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cadence =
        crate::telemetry::Cadence { every: config.telemetry_every, window: config.telemetry_window };
    let (t, flag) = (telemetry.clone(), stop.clone());
    std::thread::Builder::new()
        .name("gpu-telemetry".into())
        .spawn(move || crate::telemetry::run(sampler, t, cadence, flag))
        .context("start the GPU telemetry thread")?;
    Ok(Some(StopOnDrop(stop)))
}

/// Runs the quick preflight the agent starts with, and logs its verdict.
async fn start_up_preflight(agent_id: &str, host: Arc<dyn HostProbe>) -> Runner {
    let preflight = Runner::new(agent_id, host);
    let report = preflight.run(PreflightLevel::Quick).await;
    match failure_reason(&report) {
        Some(reason) => {
            warn!(local_id = %report.local_id, %reason, "start-up preflight failed; the controller will not schedule here")
        }
        None => {
            info!(local_id = %report.local_id, verdict = %report.verdict, class = %report.interconnect_class, "start-up preflight")
        }
    }
    preflight
}

/// The controller URLs of `--controller`: one, or several separated by commas (a group).
pub fn controller_urls(text: &str) -> anyhow::Result<Vec<String>> {
    let urls: Vec<String> =
        text.split(',').map(str::trim).filter(|u| !u.is_empty()).map(str::to_string).collect();
    if urls.is_empty() {
        anyhow::bail!("--controller {text:?} names no URL");
    }
    Ok(urls)
}

/// `--controller`'s URLs with each DNS name expanded into every address it resolves to (one
/// name for a whole controller group), each with the name TLS checks the certificate against.
/// A name that does not resolve now is kept as it is: the dialer resolves it when it dials.
pub async fn resolve_controllers(urls: Vec<String>) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for url in urls {
        let Some((host, port)) = trainyard_proto::contract::dns_name(&url) else {
            out.push((url, None));
            continue;
        };
        let addrs: Vec<std::net::SocketAddr> = match tokio::net::lookup_host((host, port)).await {
            Ok(addrs) => addrs.collect(),
            Err(e) => {
                warn!(controller = %url, error = %e, "cannot resolve the controller's name now; dialing it by name");
                Vec::new()
            }
        };
        let expanded = trainyard_proto::contract::expand_url(&url, &addrs);
        if expanded.is_empty() {
            out.push((url, None));
            continue;
        }
        if expanded.len() > 1 {
            info!(controller = %url, addresses = ?expanded, "the controller name resolves to several addresses: dialing each in turn");
        }
        out.extend(expanded.into_iter().map(|u| (u, Some(host.to_string()))));
    }
    out
}

/// A controller's endpoint, with TLS when the agent has its files (an `https` URL without
/// them is an error); `name` is the host name the certificate must carry when the URL holds
/// an address the name resolved to.
fn endpoint(url: &str, config: &AgentConfig, name: Option<&str>) -> anyhow::Result<Endpoint> {
    // HTTP/2 pings find a controller that stopped answering although its socket stays open (a
    // frozen process, a partition that drops packets): the stream ends and the agent dials the
    // next controller instead of waiting on it.
    let endpoint = Endpoint::from_shared(url.to_string())
        .with_context(|| format!("parse controller URL {url:?}"))?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(KEEPALIVE_EVERY)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .tcp_nodelay(true);
    match &config.tls {
        Some(files) => {
            let tls = client_tls(files)?;
            let tls = match name {
                Some(name) => tls.domain_name(name),
                None => tls,
            };
            endpoint.tls_config(tls).context("configure TLS")
        }
        None if url.starts_with("https://") => {
            anyhow::bail!("the controller URL {url} is https but no --tls-dir was given")
        }
        None => Ok(endpoint),
    }
}

/// tonic's client TLS from the agent's files: the controller must present a certificate of
/// this CA for the URL's host name, and the agent presents its own (an agent inside a Slurm
/// allocation has none: its job's join token stands for it).
fn client_tls(files: &crate::config::TlsFiles) -> anyhow::Result<ClientTlsConfig> {
    let read = |p: &std::path::Path, what: &str| {
        std::fs::read(p).with_context(|| format!("read the {what} {}", p.display()))
    };
    let ca = Certificate::from_pem(read(&files.ca, "controller CA")?);
    if files.cert.as_os_str().is_empty() {
        return Ok(ClientTlsConfig::new().ca_certificate(ca));
    }
    let identity =
        TlsIdentity::from_pem(read(&files.cert, "agent certificate")?, read(&files.key, "agent key")?);
    Ok(ClientTlsConfig::new().ca_certificate(ca).identity(identity))
}

/// Serves `/metrics` and `/healthz` on `at` for as long as the process runs.
async fn serve_metrics(at: std::net::SocketAddr, addr_file: Option<&std::path::Path>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(at)
        .await
        .with_context(|| format!("listen on {at} (--metrics-listen)"))?;
    let bound = listener.local_addr().context("read the bound metrics address")?;
    if let Some(path) = addr_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, bound.to_string())
            .and_then(|()| std::fs::rename(&tmp, path))
            .with_context(|| format!("write {}", path.display()))?;
    }
    info!(addr = %bound, "serving /metrics and /healthz");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, crate::metrics::router()).await {
            error!(error = %e, "the metrics listener failed");
        }
    });
    Ok(())
}

/// Capped exponential backoff with jitter.
#[derive(Debug, Default)]
struct Backoff {
    attempts: u32,
}

impl Backoff {
    fn next_delay(&mut self) -> Duration {
        let base = BACKOFF_START.saturating_mul(1 << self.attempts.min(16)).min(BACKOFF_CAP);
        self.attempts = self.attempts.saturating_add(1);
        base.mul_f64(0.5 + 0.5 * jitter())
    }
}

/// A number in [0, 1) from the std hasher's random keys: enough to spread reconnects, no
/// random-number crate needed.
fn jitter() -> f64 {
    let hash = std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now());
    (hash % 10_000) as f64 / 10_000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real resolver: `localhost` becomes each address it has here (127.0.0.1 at least),
    /// each dialed with the name TLS checks; an address stays as it is.
    #[tokio::test]
    async fn a_controller_name_is_dialed_at_each_of_its_addresses() {
        let dials =
            resolve_controllers(vec!["https://localhost:7070".into(), "http://10.1.2.3:7070".into()]).await;
        let (named, plain): (Vec<_>, Vec<_>) = dials.iter().partition(|(_, name)| name.is_some());
        assert!(named.iter().any(|(u, _)| u == "https://127.0.0.1:7070"), "{dials:?}");
        assert!(
            named.iter().all(|(u, n)| u.starts_with("https://") && n.as_deref() == Some("localhost")),
            "{dials:?}"
        );
        assert_eq!(plain, vec![&("http://10.1.2.3:7070".to_string(), None)]);
        // A name that does not resolve is kept for the dialer (and its error).
        let kept = resolve_controllers(vec!["http://no-such-host.invalid:7070".into()]).await;
        assert_eq!(kept, vec![("http://no-such-host.invalid:7070".to_string(), None)]);
    }

    #[test]
    fn a_leader_named_by_a_follower_gets_the_followers_scheme() {
        assert_eq!(
            trainyard_proto::contract::leader_url("https://ctl-a.example:7070", "ctl-b.example:7070"),
            "https://ctl-b.example:7070"
        );
        assert_eq!(
            trainyard_proto::contract::leader_url("http://127.0.0.1:1", "127.0.0.1:2/"),
            "http://127.0.0.1:2"
        );
        assert!(same_address("http://127.0.0.1:2/", "HTTP://127.0.0.1:2"));
        assert!(!same_address("http://127.0.0.1:2", "http://127.0.0.1:3"));
    }

    #[test]
    fn backoff_grows_to_its_cap_with_jitter() {
        let mut b = Backoff::default();
        let delays: Vec<Duration> = (0..12).map(|_| b.next_delay()).collect();
        assert!(delays[0] >= Duration::from_millis(50) && delays[0] <= BACKOFF_START);
        assert!(delays[3] >= Duration::from_millis(400) && delays[3] <= Duration::from_millis(800));
        for d in &delays[8..] {
            assert!(*d >= BACKOFF_CAP / 2 && *d <= BACKOFF_CAP, "{d:?}");
        }
    }
}
