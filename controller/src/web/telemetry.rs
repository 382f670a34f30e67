//! `GET /api/jobs/{id}/telemetry?metric=sm_clock|power|temp[&node=NAME]`: one node's GPU
//! telemetry during the job's current attempt, one line per GPU, against the step its rank had
//! reached at the end of each window, so the plot lines up under the job's step-time plot.
//! Without `node`, the first node of the job. The shape (docs/web.md):
//! `{"metric", "unit", "node", "nodes": [..], "x": [steps], "series": [{"label", "gpu", "rank", "values"}]}`.

use std::collections::{BTreeMap, BTreeSet};

use axum::extract::Path;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use trainyard_store::GpuWindowRecord;

use super::request::{Query, WebState, error, query_pairs, store_error};

/// Windows one request reads at most (64 GPUs x 10 s windows for ~4.5 hours).
const MAX_WINDOWS: u32 = 100_000;

/// A telemetry metric the page plots.
#[derive(Debug, Clone, Copy)]
enum Metric {
    SmClock,
    Power,
    Temp,
}

impl Metric {
    fn parse(s: &str) -> Option<Metric> {
        match s {
            "sm_clock" => Some(Metric::SmClock),
            "power" => Some(Metric::Power),
            "temp" => Some(Metric::Temp),
            _ => None,
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Metric::SmClock => "MHz",
            Metric::Power => "W",
            Metric::Temp => "°C",
        }
    }

    fn read(self, w: &GpuWindowRecord) -> Option<f64> {
        match self {
            Metric::SmClock => w.sm_clock_mean,
            Metric::Power => w.power_mean,
            Metric::Temp => w.gpu_temp_max,
        }
    }
}

pub(super) async fn telemetry(
    state: WebState,
    headers: HeaderMap,
    Path(raw): Path<String>,
    query: Query,
) -> Response {
    let web = state.0;
    let caller = match web.caller(&headers).await {
        Ok(c) => c,
        Err(refused) => return refused.into_response(),
    };
    let pairs = match query_pairs(&query.0) {
        Ok(p) => p,
        Err(refused) => return refused.into_response(),
    };
    let metric = match pairs.iter().find(|(k, _)| k == "metric").map(|(_, v)| v.as_str()) {
        Some(m) => match Metric::parse(m) {
            Some(m) => m,
            None => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("unknown metric {m:?}: sm_clock, power or temp"),
                );
            }
        },
        None => return error(StatusCode::BAD_REQUEST, "metric is required: sm_clock, power or temp"),
    };
    let record = match web.job_for(&caller, &raw).await {
        Ok(r) => r,
        Err(refused) => return refused.into_response(),
    };
    let windows = match web.controller.receipts().gpu_windows(record.id, record.attempt, MAX_WINDOWS).await {
        Ok(w) => w,
        Err(e) => return store_error(e).into_response(),
    };
    let nodes: BTreeSet<&str> = windows.iter().map(|w| w.agent_id.as_str()).collect();
    let node = match pairs.iter().find(|(k, _)| k == "node").map(|(_, v)| v.as_str()) {
        Some(n) if !nodes.contains(n) => {
            return error(
                StatusCode::NOT_FOUND,
                format!("job {} has no telemetry from node {n:?}", record.id),
            );
        }
        Some(n) => Some(n),
        None => nodes.first().copied(),
    };
    let Some(node) = node else {
        let empty = json!({"metric": metric_name(metric), "unit": metric.unit(), "node": null, "nodes": [], "x": [], "series": []});
        return super::api::json_ok(empty);
    };
    super::api::json_ok(lines(metric, node, &nodes, &windows))
}

fn metric_name(m: Metric) -> &'static str {
    match m {
        Metric::SmClock => "sm_clock",
        Metric::Power => "power",
        Metric::Temp => "temp",
    }
}

/// One line per GPU of `node`; x is the union of the windows' last steps.
fn lines(metric: Metric, node: &str, nodes: &BTreeSet<&str>, windows: &[GpuWindowRecord]) -> Value {
    let mine: Vec<&GpuWindowRecord> =
        windows.iter().filter(|w| w.agent_id == node && w.last_step.is_some()).collect();
    let x: Vec<i64> = mine.iter().filter_map(|w| w.last_step).collect::<BTreeSet<_>>().into_iter().collect();
    let index: BTreeMap<i64, usize> = x.iter().enumerate().map(|(i, s)| (*s, i)).collect();
    let mut by_gpu: BTreeMap<u32, (Option<u32>, Vec<Value>)> = BTreeMap::new();
    for w in &mine {
        let line = by_gpu.entry(w.gpu).or_insert_with(|| (w.rank, vec![Value::Null; x.len()]));
        if let (Some(step), Some(v)) = (w.last_step, metric.read(w))
            && let Some(&i) = index.get(&step)
        {
            line.1[i] = json!(v);
        }
    }
    let series: Vec<Value> = by_gpu
        .into_iter()
        .map(|(gpu, (rank, values))| {
            let label = rank.map_or_else(|| format!("GPU {gpu}"), |r| format!("GPU {gpu} · rank {r}"));
            json!({"label": label, "gpu": gpu, "rank": rank, "values": values})
        })
        .collect();
    json!({
        "metric": metric_name(metric),
        "unit": metric.unit(),
        "node": node,
        "nodes": nodes.iter().collect::<Vec<_>>(),
        "x": x,
        "series": series,
    })
}
