//! The web view, on the controller's HTTP listener beside `/metrics`: pages for jobs, one job,
//! nodes and a comparison, and the JSON they read. Same authentication as `ctl`: the API takes
//! a bearer token (the page keeps one in the browser's local storage and asks for it on a 401);
//! in the loopback demo a call without one acts as the local admin.
//!
//! # Layout
//! - this module: the routes and the embedded assets (`controller/web/`, built into the
//!   binary: nothing is fetched at run time).
//! - `request`: what the handlers share: authentication, query parsing, refusals.
//! - `api`: the JSON of each endpoint, from the controller's views and the store.
//! - `telemetry`: a node's GPU telemetry during a job, against its steps.
//!
//! Every bad input (unknown job, malformed or huge query values) is a 4xx with a one-line
//! message, never a 500.

mod api;
mod request;
mod telemetry;

use std::sync::Arc;

use axum::Router;
use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::auth::Authenticator;
use crate::core::Controller;
use request::{Web, error};

/// The web view's routes, to merge into the HTTP listener's router.
pub fn routes(controller: Arc<Controller>, auth: Authenticator) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/jobs/{id}", get(page))
        .route("/nodes", get(page))
        .route("/compare", get(page))
        .route("/assets/{file}", get(asset))
        .route("/api/jobs", get(api::jobs))
        .route("/api/jobs/{id}", get(api::job))
        .route("/api/jobs/{id}/series", get(api::series))
        .route("/api/jobs/{id}/telemetry", get(telemetry::telemetry))
        .route("/api/nodes", get(api::nodes))
        .route("/api/compare", get(api::compare))
        .with_state(Web { controller, auth })
}

const INDEX: &str = include_str!("../../web/index.html");

async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")], INDEX)
        .into_response()
}

const JS: &str = "text/javascript; charset=utf-8";

/// The static files, built into the binary: the page's ES modules (`app.js` imports the rest),
/// its style and the vendored plotting library.
async fn asset(Path(file): Path<String>) -> Response {
    let (body, kind): (&'static [u8], &str) = match file.as_str() {
        "app.js" => (include_bytes!("../../web/app.js"), JS),
        "common.js" => (include_bytes!("../../web/common.js"), JS),
        "plots.js" => (include_bytes!("../../web/plots.js"), JS),
        "jobs.js" => (include_bytes!("../../web/jobs.js"), JS),
        "nodes.js" => (include_bytes!("../../web/nodes.js"), JS),
        "compare.js" => (include_bytes!("../../web/compare.js"), JS),
        "style.css" => (include_bytes!("../../web/style.css"), "text/css; charset=utf-8"),
        "uPlot.iife.min.js" => {
            (include_bytes!("../../web/vendor/uPlot.iife.min.js"), "text/javascript; charset=utf-8")
        }
        "uplot.min.css" => (include_bytes!("../../web/vendor/uplot.min.css"), "text/css; charset=utf-8"),
        _ => return error(StatusCode::NOT_FOUND, format!("no asset {file}")),
    };
    ([(header::CONTENT_TYPE, kind), (header::CACHE_CONTROL, "max-age=300")], body).into_response()
}
