//! The controller's HTTP listener, beside the gRPC one: `/metrics` for Prometheus, `/healthz`
//! for load balancers and probes, and the web view. Bad paths and methods are 4xx with a
//! message.
//!
//! The listener is as safe as the gRPC one ([`Exposure`]): on loopback it follows the gRPC
//! listener's policy (the demo's tokenless local admin included); off loopback a call always
//! needs a token, the listener serves HTTPS with the controller's certificate when TLS is
//! configured (and refuses to start in plain text unless told so, in `main`), and `/metrics`
//! needs a token unless the operator opted in to a public scrape endpoint.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::server::TlsStream;

use crate::auth::{AuthError, Authenticator};
use crate::core::Controller;
use crate::metrics::{CONTENT_TYPE, metrics};
use crate::tls::TlsFiles;

/// How the HTTP listener is exposed, decided from its address and the flags.
#[derive(Debug, Clone, Default)]
pub struct Exposure {
    /// HTTPS with these files (the gRPC listener's certificate and key).
    pub tls: Option<TlsFiles>,
    /// `/metrics` answers without a token (`--metrics-public`); otherwise it needs one off
    /// loopback.
    pub public_metrics: bool,
}

/// Requests the HTTP listener serves at once; more are answered 503 at once rather than queued,
/// so a flood of page loads cannot pile up store reads.
pub const MAX_CONCURRENT_HTTP_REQUESTS: usize = 64;
/// Longest one HTTP request may take (a job page of millions of receipts answers in seconds).
pub const HTTP_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The routes, over `controller`: metrics, health and the web view (`crate::web`), behind the
/// concurrency limit and the request timeout. `metrics_need_token`: `/metrics` asks for a user's
/// token, as the web API does.
pub fn router(controller: Arc<Controller>, auth: Authenticator, metrics_need_token: bool) -> Router {
    let scrape_state = Scrape { controller: controller.clone(), auth: auth.clone(), metrics_need_token };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_HTTP_REQUESTS));
    let refusals = (controller.clone(), auth.clone());
    let controller_for_health = controller.clone();
    Router::new()
        .route("/metrics", get(scrape))
        .with_state(scrape_state)
        .route("/healthz", get(move || healthz(controller_for_health)))
        .fallback(not_found)
        .merge(crate::web::routes(controller, auth))
        .layer(axum::middleware::from_fn_with_state(slots, limit))
        .layer(axum::middleware::from_fn_with_state(refusals.1.clone(), loopback_doors))
        .layer(axum::middleware::from_fn_with_state(refusals, note_refusals))
}

/// The loopback demo's HTTP doors ([`crate::auth::peer`]): only requests addressed to the
/// loopback (a page of another site rebinding its name to 127.0.0.1 gets 403), and a request
/// without a token only from the account that started the controller (401). Off the demo,
/// every call needs a token anyway and this lets everything through.
async fn loopback_doors(
    State(auth): State<Authenticator>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if auth.policy().require_user_token {
        return next.run(request).await;
    }
    let host = request.headers().get(header::HOST).map(|v| v.to_str().unwrap_or("?"));
    if !crate::auth::peer::is_loopback_host(host) {
        return (
            StatusCode::FORBIDDEN,
            format!(
                "this loopback demo controller answers only requests for localhost, 127.0.0.1 or [::1], not Host {}\n",
                host.unwrap_or_default()
            ),
        )
            .into_response();
    }
    if request.headers().get(header::AUTHORIZATION).is_none() {
        let peer = request.extensions().get::<axum::extract::ConnectInfo<Peer>>().map(|c| c.0.0);
        if let Err(e) = auth.tokenless_from(peer) {
            return (StatusCode::UNAUTHORIZED, format!("{e}\n")).into_response();
        }
    }
    next.run(request).await
}

/// Where a request came from (served with `into_make_service_with_connect_info::<Peer>`), for
/// the door ([`crate::auth::door`]).
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub SocketAddr);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, NoDelay>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, NoDelay>) -> Peer {
        Peer(*stream.remote_addr())
    }
}

/// The plain HTTP listener, whose connections send small answers at once (TCP_NODELAY), not
/// after the peer's delayed ACK.
pub struct NoDelay(pub TcpListener);

impl axum::serve::Listener for NoDelay {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        let (tcp, peer) = axum::serve::Listener::accept(&mut self.0).await;
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on a connection");
        }
        (tcp, peer)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TlsListener>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, TlsListener>) -> Peer {
        Peer(*stream.remote_addr())
    }
}

/// Tells the door of every request refused for want of a valid credential (401), by address.
async fn note_refusals(
    State((controller, auth)): State<(Arc<Controller>, Authenticator)>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let peer = request.extensions().get::<axum::extract::ConnectInfo<Peer>>().map(|c| c.0.0.ip());
    let response = next.run(request).await;
    if let Some(ip) = peer
        && response.status() == StatusCode::UNAUTHORIZED
    {
        auth.note_refused(ip, controller.now_ms());
    }
    response
}

/// The concurrency limit and the timeout of every HTTP request.
async fn limit(
    State(slots): State<Arc<tokio::sync::Semaphore>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Ok(_permit) = slots.try_acquire() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            format!("busy: {MAX_CONCURRENT_HTTP_REQUESTS} requests in progress; try again in a second\n"),
        )
            .into_response();
    };
    match tokio::time::timeout(HTTP_REQUEST_TIMEOUT, next.run(request)).await {
        Ok(response) => response,
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the request took longer than {} s and was stopped\n", HTTP_REQUEST_TIMEOUT.as_secs()),
        )
            .into_response(),
    }
}

#[derive(Clone)]
struct Scrape {
    controller: Arc<Controller>,
    auth: Authenticator,
    metrics_need_token: bool,
}

async fn scrape(State(s): State<Scrape>, headers: HeaderMap) -> Response {
    if s.metrics_need_token {
        let given = headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or("?"));
        if given.is_none() {
            return (
                StatusCode::UNAUTHORIZED,
                "/metrics on this address needs a token (Authorization: Bearer ...; Prometheus: \
                 authorization.credentials_file), or start the controller with --metrics-public\n",
            )
                .into_response();
        }
        match s.auth.user(given, s.controller.now_ms()).await {
            Ok(_) => {}
            Err(AuthError::Unauthenticated(why)) => {
                return (StatusCode::UNAUTHORIZED, why + "\n").into_response();
            }
            Err(AuthError::PermissionDenied(why)) => {
                return (StatusCode::FORBIDDEN, why + "\n").into_response();
            }
            Err(AuthError::Store(_)) => {
                return (StatusCode::SERVICE_UNAVAILABLE, "the store is unavailable; try again\n")
                    .into_response();
            }
        }
    }
    s.controller.refresh_gauges();
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics().encode()).into_response()
}

/// 200 while the controller serves, leader or follower, and which it is: `ok: leads` (with its
/// epoch in a group), or `ok: follows LEADER at ADDRESS` (probes that want the leader match
/// `leads`). The store's health shows in `/metrics` (`trainyard_store_errors_total`).
async fn healthz(controller: Arc<Controller>) -> String {
    let l = controller.role().leadership();
    match (l.leads, l.epoch) {
        (true, 0) => "ok: leads\n".to_string(),
        (true, epoch) => format!("ok: leads (controller {}, epoch {epoch})\n", l.controller_id),
        (false, 0) => {
            format!("ok: follows (controller {}); no leader is elected right now\n", l.controller_id)
        }
        (false, epoch) => format!(
            "ok: follows (controller {}); the leader is {} at {} (epoch {epoch})\n",
            l.controller_id, l.leader_id, l.leader_address
        ),
    }
}

async fn not_found(uri: axum::http::Uri) -> (StatusCode, String) {
    (
        StatusCode::NOT_FOUND,
        format!("no page {}; this listener serves the web view at /, /metrics and /healthz\n", uri.path()),
    )
}

/// Longest a client may take over its TLS handshake before the connection is dropped.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; further connections wait in the kernel's backlog.
pub const MAX_TLS_HANDSHAKES: usize = 256;

/// A TLS listener for `axum::serve`: handshakes run in tasks of their own (bounded in number
/// and time), so one slow client never holds up the others; finished ones are handed over.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Wraps `listener` with the certificate and key of `files`. A connection from an address
    /// `admit` refuses (the door: [`crate::auth::door`]) is closed before its handshake.
    pub fn new(
        listener: TcpListener,
        files: &TlsFiles,
        admit: impl Fn(std::net::IpAddr) -> bool + Send + 'static,
    ) -> anyhow::Result<Self> {
        let local = listener.local_addr().context("read the HTTP listener's address")?;
        let acceptor = TlsAcceptor::from(Arc::new(server_config(files)?));
        let (tx, ready) = mpsc::channel(64);
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_TLS_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(permit) = slots.clone().acquire_owned().await else { return };
                let (tcp, peer) = match listener.accept().await {
                    Ok(pair) => pair,
                    Err(e) => {
                        tracing::warn!(error = %e, "HTTPS accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                if !admit(peer.ip()) {
                    continue;
                }
                // Small answers go out at once, not after the peer's delayed ACK.
                let _ = tcp.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "HTTPS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "HTTPS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { ready, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(pair) => pair,
            // The accept loop ended (it never does while the listener lives): serve nothing more.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// The rustls server configuration of the controller's certificate and key.
fn server_config(files: &TlsFiles) -> anyhow::Result<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("read the certificate {}: {e}", files.cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| anyhow::anyhow!("read the key {}: {e}", files.key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("choose TLS versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("use the certificate and key for HTTPS")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}
