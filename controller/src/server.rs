//! The server entry point: `run(listener, controller, shutdown)`, as in mini-redis. `main`
//! passes ctrl-c/SIGTERM; tests bind port 0 and pass anything.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use trainyard_proto::v1::agents_server::AgentsServer;
use trainyard_proto::v1::jobs_server::JobsServer;

use crate::core::Controller;
use crate::service::{AgentsService, JobsService};

/// Serves `Jobs`, `Agents` and `grpc.health.v1.Health` on `listener`, and `/metrics` and
/// `/healthz` on `http` when given, until `shutdown` resolves; then ends every agent and watch
/// stream and returns once in-flight requests are answered.
pub async fn run(
    listener: TcpListener,
    http: Option<TcpListener>,
    controller: Arc<Controller>,
    shutdown: impl Future,
) -> anyhow::Result<()> {
    let token = CancellationToken::new();
    let background = tokio::spawn(controller.clone().run_background(token.clone()));
    let http_server = http.map(|listener| {
        let routes = crate::http::router(controller.clone());
        let stop = token.clone();
        tokio::spawn(async move {
            let serve =
                axum::serve(listener, routes).with_graceful_shutdown(async move { stop.cancelled().await });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "the HTTP listener (/metrics) failed");
            }
        })
    });
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<JobsServer<JobsService>>().await;
    health.set_serving::<AgentsServer<AgentsService>>().await;
    let jobs = JobsServer::new(JobsService::new(controller.clone(), token.clone()));
    let agents = AgentsServer::new(AgentsService::new(controller, token.clone()))
        .max_decoding_message_size(64 * 1024 * 1024);
    let stop = token.clone();
    let result = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(health_service)
        .add_service(jobs)
        .add_service(agents)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
            shutdown.await;
            tracing::info!("shutting down: closing agent and watch streams");
            stop.cancel();
        })
        .await;
    token.cancel();
    // Probes see the controller go away before its port closes.
    health.set_not_serving::<JobsServer<JobsService>>().await;
    let _ = background.await;
    if let Some(server) = http_server {
        let _ = server.await;
    }
    result.map_err(|e| anyhow::anyhow!("gRPC server failed: {e}"))
}
