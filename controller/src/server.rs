//! The server entry point: `run(listener, http, controller, security, shutdown)`, as in
//! mini-redis. `main` passes ctrl-c/SIGTERM; tests bind port 0 and pass anything.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use trainyard_proto::limits;
use trainyard_proto::v1::agents_server::AgentsServer;
use trainyard_proto::v1::jobs_server::JobsServer;

use crate::auth::{Authenticator, Policy};
use crate::core::Controller;
use crate::http::{Exposure, Peer, TlsListener};
use crate::service::{AgentsService, JobsService};
use crate::tls::TlsFiles;

/// Requests (streams included) one gRPC connection may have in flight; more wait.
pub const MAX_CONCURRENT_REQUESTS_PER_CONNECTION: usize = 256;
/// Headers of one gRPC request (a token is under 100 bytes): larger ones are refused by HTTP/2.
pub const MAX_HEADER_BYTES: u32 = 16 << 10;
/// Longest a unary gRPC call may take before it is answered `Cancelled`; above the longest wait
/// a call does on purpose (`ctl preflight --run`, 2 minutes). Streams are not cut by it: it
/// bounds the time to a stream's first response only.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(150);

/// The gRPC health service name that is `SERVING` on the leader of a group (or a lone
/// controller) only; `trainyard.v1.Jobs` is served by every member, `trainyard.v1.Agents` by
/// the leader alone.
pub const LEADER_HEALTH_SERVICE: &str = "trainyard.v1.Leader";

/// How the gRPC listener is secured: TLS (none on the loopback demo) and who must prove what.
#[derive(Debug, Clone)]
pub struct Security {
    pub tls: Option<TlsFiles>,
    pub policy: Policy,
}

impl Security {
    /// Plaintext on loopback, tokenless calls as the local admin: the demo and most tests.
    pub fn demo() -> Self {
        Security { tls: None, policy: Policy::demo() }
    }
}

/// Serves `Jobs`, `Agents` and `grpc.health.v1.Health` on `listener`, and `/metrics`,
/// `/healthz` and the web view on `http` when given (exposed as its [`Exposure`] says), until
/// `shutdown` resolves; then ends every agent and watch stream and returns once in-flight
/// requests are answered.
pub async fn run(
    listener: TcpListener,
    http: Option<(TcpListener, Exposure)>,
    controller: Arc<Controller>,
    security: Security,
    shutdown: impl Future,
) -> anyhow::Result<()> {
    let auth = crate::auth::Authenticator::new(controller.auth().clone(), security.policy.clone());
    let leads = controller.role().leads();
    if leads {
        auth.ensure_local_admin(controller.now_ms()).await.context("create the local admin user")?;
    }
    let (door, clock) = (auth.door(), controller.clone());
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &security.tls {
        builder = builder.tls_config(tls.load()?).context("configure TLS")?;
    }
    let token = CancellationToken::new();
    // The leader reconciles and diagnoses; a follower only mirrors the store (`core::follow`).
    let (background, live) = if leads {
        let background = tokio::spawn(controller.clone().run_background(token.clone()));
        (background, Some(controller.spawn_live(token.clone()).map_err(anyhow::Error::msg)?))
    } else {
        (tokio::spawn(controller.clone().mirror(token.clone())), None)
    };
    let http_server = match http {
        Some((listener, exposure)) => Some(serve_http(listener, exposure, &controller, &auth, &token)?),
        None => None,
    };
    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, leads).await;
    let jobs = JobsServer::new(JobsService::new(controller.clone(), auth.clone(), token.clone()))
        .max_decoding_message_size(limits::MAX_REQUEST_BYTES)
        .max_encoding_message_size(limits::MAX_RESPONSE_BYTES);
    let agents = AgentsServer::new(AgentsService::new(
        controller,
        security.policy.require_agent_cert,
        auth.clone(),
        token.clone(),
    ))
    .max_decoding_message_size(limits::MAX_AGENT_MESSAGE_BYTES)
    .max_encoding_message_size(limits::MAX_AGENT_MESSAGE_BYTES);
    let stop = token.clone();
    let incoming = admitted(listener, door, clock);
    let result = builder
        .concurrency_limit_per_connection(MAX_CONCURRENT_REQUESTS_PER_CONNECTION)
        .max_concurrent_streams(Some(MAX_CONCURRENT_REQUESTS_PER_CONNECTION as u32))
        .http2_max_header_list_size(Some(MAX_HEADER_BYTES))
        .timeout(REQUEST_TIMEOUT)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(health_service)
        .add_service(jobs)
        .add_service(agents)
        .serve_with_incoming_shutdown(incoming, async move {
            shutdown.await;
            tracing::info!("shutting down: closing agent and watch streams");
            stop.cancel();
        })
        .await;
    token.cancel();
    // Probes see the controller go away before its port closes.
    health.set_not_serving::<JobsServer<JobsService>>().await;
    health.set_service_status(LEADER_HEALTH_SERVICE, tonic_health::ServingStatus::NotServing).await;
    let _ = background.await;
    if let Some(live) = live {
        let _ = live.await;
    }
    if let Some(server) = http_server {
        let _ = server.await;
    }
    result.map_err(|e| anyhow::anyhow!("gRPC server failed: {e}"))
}

/// The gRPC health service: the jobs service always serves; the agents service and the
/// leader's own entry only while this controller leads.
async fn set_health(health: &tonic_health::server::HealthReporter, leads: bool) {
    health.set_serving::<JobsServer<JobsService>>().await;
    if leads {
        health.set_serving::<AgentsServer<AgentsService>>().await;
        health.set_service_status(LEADER_HEALTH_SERVICE, tonic_health::ServingStatus::Serving).await;
    } else {
        health.set_not_serving::<AgentsServer<AgentsService>>().await;
        health.set_service_status(LEADER_HEALTH_SERVICE, tonic_health::ServingStatus::NotServing).await;
    }
}

/// The gRPC listener's connections: those from an address the door has limited are closed
/// here, before TLS; the rest get TCP_NODELAY here, since a server fed its connections
/// (`serve_with_incoming`) never applies the builder's `tcp_nodelay`, and without it a small
/// reply (a submit's answer, a launch to an agent) waited on Nagle's algorithm for the peer's
/// delayed ACK, 40 ms a time.
fn admitted(
    listener: TcpListener,
    door: Arc<crate::auth::door::Door>,
    clock: Arc<Controller>,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    tokio_stream::StreamExt::filter_map(TcpListenerStream::new(listener), move |conn| match conn {
        Ok(stream) => {
            let admitted = stream.peer_addr().map_or(true, |peer| door.admit(peer.ip(), clock.now_ms()));
            admitted.then(|| {
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(error = %e, "cannot set TCP_NODELAY on a connection");
                }
                Ok(stream)
            })
        }
        Err(e) => Some(Err(e)),
    })
}

/// Starts the HTTP listener's server. Off loopback the demo's tokenless admin never applies
/// (every call needs a token) and `/metrics` needs one unless public; with TLS files it speaks
/// HTTPS.
fn serve_http(
    listener: TcpListener,
    exposure: Exposure,
    controller: &Arc<Controller>,
    auth: &Authenticator,
    token: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let loopback = listener.local_addr().context("read the HTTP listener's address")?.ip().is_loopback();
    let auth = if loopback {
        auth.clone()
    } else {
        auth.with_policy(Policy { require_user_token: true, ..auth.policy().clone() })
    };
    let door = auth.door();
    let routes = crate::http::router(controller.clone(), auth, !loopback && !exposure.public_metrics);
    let stop = token.clone();
    let stopped = async move { stop.cancelled().await };
    Ok(match &exposure.tls {
        Some(files) => {
            let clock = controller.clone();
            let admit = move |ip| door.admit(ip, clock.now_ms());
            let tls = TlsListener::new(listener, files, admit)?;
            let routes = routes.into_make_service_with_connect_info::<Peer>();
            tokio::spawn(async move {
                if let Err(e) = axum::serve(tls, routes).with_graceful_shutdown(stopped).await {
                    tracing::error!(error = %e, "the HTTPS listener failed");
                }
            })
        }
        None => tokio::spawn(async move {
            let routes = routes.into_make_service_with_connect_info::<Peer>();
            if let Err(e) =
                axum::serve(crate::http::NoDelay(listener), routes).with_graceful_shutdown(stopped).await
            {
                tracing::error!(error = %e, "the HTTP listener failed");
            }
        }),
    })
}

/// Raises this process's open-file limit to its hard limit: every agent holds a connection, and
/// a fleet of 1,000 hosts with `ctl` clients, the web view and the database pool is past the
/// 1,024 many systems give a process by default. Returns (before, after).
pub fn raise_open_file_limit() -> std::io::Result<(u64, u64)> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit of this process with a valid struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let before = lim.rlim_cur;
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: as above; the soft limit is raised to the hard limit, which needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((before, lim.rlim_cur))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_limit() {
        let (before, after) = super::raise_open_file_limit().expect("getrlimit works");
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit of this process with a valid struct.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert!(after >= before);
        assert_eq!(lim.rlim_cur, after);
        assert_eq!(lim.rlim_cur, lim.rlim_max, "the soft limit is the hard limit now");
    }
}
