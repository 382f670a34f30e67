//! The controller's HTTP listener, beside the gRPC one: `/metrics` for Prometheus and
//! `/healthz` for load balancers and probes. Bad paths and methods are 4xx with a message.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::auth::Authenticator;
use crate::core::Controller;
use crate::metrics::{CONTENT_TYPE, metrics};

/// The routes, over `controller`: metrics, health and the web view (`crate::web`).
pub fn router(controller: Arc<Controller>, auth: Authenticator) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .route("/healthz", get(healthz))
        .fallback(not_found)
        .with_state(controller.clone())
        .merge(crate::web::routes(controller, auth))
}

async fn scrape(State(controller): State<Arc<Controller>>) -> impl IntoResponse {
    controller.refresh_gauges();
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], metrics().encode())
}

/// 200 while the controller serves; the store's health shows in `/metrics`
/// (`trainyard_store_errors_total`).
async fn healthz() -> &'static str {
    "ok\n"
}

async fn not_found(uri: axum::http::Uri) -> (StatusCode, String) {
    (
        StatusCode::NOT_FOUND,
        format!("no page {}; this listener serves the web view at /, /metrics and /healthz\n", uri.path()),
    )
}
